# Call 5 (issue 70 on the GPU machine): the engine moved into moeplug's own files behind hook points (the scheduler's
# mechanisms into ggml-moeplug-sched.inc, CUDA's expert-copy entry points into moeplug-expert-copy.cu, the flags and
# settings into common's overlay files). The CPU build's bitwise tests pass; what only a GPU says:
#   1. the CUDA build of this tree compiles and links (nvcc here compiled ggml-cuda.cu and moeplug-expert-copy.cu alone);
#   2. exactness on CUDA: test-backend-ops' MUL_MAT_ID and ADD_ID cases (negative ids) on CUDA0, then
#      tests/test_gpu_prompt.py (prompt batches through the GPU's expert copy, from the slots and ahead, byte-identical
#      to stock's offload; the short-prompt flag; misses read in place) and tests/test_spec_cache.py -k gpu;
#   3. one serve_bench row, the Qwen3-30B-A3B shape at 12 GiB on unseen text, 2 rounds, beside the same row before the
#      move (README's speed table, run `2026-12-02-new-prompt-prefill`: prefill 1.10x (lowest 1.01x), decode 1.29x
#      (lowest 1.17x), 3 rounds of 8 prompts): the ratios to stock in this run should fall within those rounds' noise.
# Carry: .carry (sdist) and .whl from native/bench/device/prepare.sh; a packed build of this tree in .carry/build.txz.*
# (from a first run of this script, $OUT/build.txz.*) saves the 4-minute build. About 10 minutes cold, 7 warm.
source native/bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t=$SECONDS; BIN=$(bin_dir) || exit 1; echo "BIN=$BIN build $((SECONDS-t)) s"
ID=$(basename $(dirname $BIN))
if ! ls .carry/build.txz.* > /dev/null 2>&1; then
    t=$SECONDS; tar c -C ~/.local/share/moeplug/builds $ID | xz -T16 -6 | split -b 15M - $OUT/build.txz.; echo "pack $((SECONDS-t)) s"
fi
# test-backend-ops is configured with every build but not built: build it in the build's own folder (about a minute)
t=$SECONDS; OPS=""
if [ -d ~/.cache/moeplug/build/$ID ] && cmake --build ~/.cache/moeplug/build/$ID -j 16 --target test-backend-ops > $OUT/ops-build.txt 2>&1; then
    OPS=~/.cache/moeplug/build/$ID/bin/test-backend-ops
fi
echo "test-backend-ops build $((SECONDS-t)) s: ${OPS:-not built (a carried build has no build folder)}"
if [ -n "$OPS" ]; then
    for op in MUL_MAT_ID ADD_ID; do
        timeout 120 $OPS test -b CUDA0 -o $op > $OUT/ops-$op.txt 2>&1; echo "test-backend-ops $op rc=$?"; tail -2 $OUT/ops-$op.txt
    done
fi
MOEPLUG_GPU_BIN=$BIN timeout $((330 - SECONDS)) python3 -m pytest tests/test_gpu_prompt.py "tests/test_spec_cache.py::test_speculation_on_a_gpu_build" \
    -p no:cacheprovider -q 2>&1 | tee $OUT/gpu-tests.txt | tail -4
echo "tests done $SECONDS s"
timeout $((590 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads text --max-prompts 8 -n 64 \
    --rounds 2 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/row.json > $OUT/row.md 2> $OUT/row.err
echo "serve_bench rc=$? $SECONDS s"; tail -2 $OUT/row.err
grep -E "^\| 12 GiB|round by round|95% interval" $OUT/row.md
echo "before the move (run 2026-12-02-new-prompt-prefill, 3 rounds): prefill 1.10x (lowest 1.01x), decode 1.29x (lowest 1.17x)"
echo "total $SECONDS s"
