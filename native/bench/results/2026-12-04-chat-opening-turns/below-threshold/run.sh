# call H: below the plans' threshold: prompts of 6 random tokens, Qwen3 shape at 12 GiB, the plan (batches below 8 on the
# decode path: slots on the GPU, misses on the CPU) against the same plan with --moe-cache-offload-min-batch 4 (the GPU's
# prompt path); stock computes them on the CPU (llama.cpp's 32)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
timeout $((290 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 6 --random-prompts 6 --ctx 4096 -n 16 --rounds 2 --prefill-reps 3 --row-args 'none;--moe-cache-offload-min-batch 4' --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((270 - SECONDS)) --json $OUT/r6.json > $OUT/r6.md 2> $OUT/r6.err; echo "r6 rc=$? $SECONDS s"; tail -4 $OUT/r6.err
grep -E "^\| 12 GiB" $OUT/r6.md | head; grep "first request alone" $OUT/r6.md; echo "total $SECONDS s"
