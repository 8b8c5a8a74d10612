# Call 1: misses read in place (patch 0026, LLAMA_MOE_CACHE_DIRECT=1), first light on the H200.
# The CUDA build of this tree, packed for the next calls; the GPU test that says the misses read in place give
# stock's own full offload's results; then the Qwen3 shape at 12 GiB, 44 random tokens, 64 generated, two rounds,
# moeplug with and without the variable against stock --fit.
# Question (issue 23, DESIGN.md "Misses read in place"): does reading a token's misses from pinned RAM on the GPU
# beat computing them on the CPU? Estimated 135-185 t/s against moeplug's 114 and stock's 82 (run `2026-12-04-chat-16gib`).
# Carry: .carry (sdist, trace) and .whl, from native/bench/device/prepare.sh. About 9 minutes.
source native/bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t=$SECONDS; BIN=$(bin_dir) || exit 1; echo "BIN=$BIN build $((SECONDS-t)) s"
ID=$(basename $(dirname $BIN))
t=$SECONDS; tar c -C ~/.local/share/moeplug/builds $ID | xz -T16 -6 | split -b 15M - $OUT/build.txz.; echo "pack $((SECONDS-t)) s"; ls -la $OUT
MOEPLUG_GPU_BIN=$BIN timeout $((330 - SECONDS)) python3 -m pytest -x tests/test_gpu_prompt.py -k in_place -p no:cacheprovider -v 2>&1 | tee $OUT/gpu_prompt.txt | tail -8
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 44 --random-prompts 6 --ctx 4096 -n 64 --rounds 2 --prefill-reps 2 --row-env LLAMA_MOE_CACHE_DIRECT=unset,1 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/direct.json > $OUT/direct.md 2> $OUT/direct.err; echo "direct rc=$? $SECONDS s"; tail -3 $OUT/direct.err
grep -E "^\| 12 GiB|round by round|first request alone" $OUT/direct.md; grep -h "moe-cache:" ~/.local/state/moeplug/logs/*.log 2>/dev/null | sort | uniq -c | head -4; echo "total $SECONDS s"
