# Call 0e (issue "On the GPU machine when it is lent", run 1: stock means stock): why does stock's --fit place less on
# the GPU in the patched build? Run 2026-12-07-engine-move-h100 gave both builds the same flags (-c 4096 --fit on
# -fitt 68791 -lm none -np 1, the Qwen3-30B-A3B shape at 12 GiB): the unpatched build held 12444 MiB and decoded
# 133 t/s, the patched one 11916 MiB (one layer's experts less) and 127.5 t/s. This call prints what each build's fit
# decides and why: llama-fit-params with the same target (its memory breakdown and the -ngl/-ot it picks), then each
# llama-server's fit lines and the buffers it allocated, side by side.
# Carry: .carry (sdist) and .whl. About 8 minutes (both CUDA builds, 3 minutes each).
source native/bench/device/setup.sh || exit 1
t=$SECONDS; BIN=$(bin_dir) || exit 1; SBIN=$(bin_dir --stock) || exit 1; echo "builds $((SECONDS-t)) s"
[ -f /tmp/moeplug-bench/qwen3-30b-a3b-shape.gguf ] || python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --build-only \
    --prebuilt-moeplug $BIN --prebuilt-stock $SBIN > $OUT/prepare.txt 2>&1
M=/tmp/moeplug-bench/qwen3-30b-a3b-shape.gguf
for side in patched:$BIN stock:$SBIN; do
    name=${side%%:*}; bin=${side#*:}
    timeout 120 $bin/llama-fit-params -m $M -c 4096 -fitt 68791 -np 1 --fit-print on > $OUT/fit-params-$name.txt 2>&1
    echo "$name llama-fit-params rc=$?"; grep -vE "^(llama_model_loader|print_info|load_tensors):" $OUT/fit-params-$name.txt | tail -25
    timeout 150 $bin/llama-server -m $M -c 4096 --fit on -fitt 68791 -lm none -np 1 -lv 4 --port 8391 > $OUT/server-$name.txt 2>&1 &
    pid=$!; for i in $(seq 120); do curl -sf localhost:8391/health > /dev/null && break; sleep 1; done
    nvidia-smi --query-gpu=memory.used --format=csv,noheader | sed "s/^/$name GPU memory used: /"; kill $pid; wait $pid
    grep -iE "fit|buffer size|offload|CUDA0 (model|KV|compute)" $OUT/server-$name.txt | head -40
done
diff <(grep -iE "buffer size" $OUT/server-patched.txt) <(grep -iE "buffer size" $OUT/server-stock.txt)
echo "total $SECONDS s"
