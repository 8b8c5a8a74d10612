# call B: the flag's GPU test (10-token batches bitwise stock's own offload of them; without the variable they differ,
# so the flag alone moved them); 12-token random prompts, Qwen3 shape at 12 GiB: the plan (the flag at 8) against
# the same plan with --moe-cache-offload-min-batch 0 (llama.cpp's 32: these prompts on the CPU)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
MOEPLUG_GPU_BIN=$BIN timeout 200 python3 -m pytest tests/test_gpu_prompt.py -k short -p no:cacheprovider -v 2>&1 | tee $OUT/gpu_short.txt | tail -5
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 12 --random-prompts 8 --ctx 4096 -n 32 --rounds 2 --prefill-reps 3 --row-args 'none;--moe-cache-offload-min-batch 0' --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((560 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -8 $OUT/a.err
grep -E "^\| 12 GiB" $OUT/a.md | head; grep "first request alone\|round by round" $OUT/a.md; echo "total $SECONDS s"
