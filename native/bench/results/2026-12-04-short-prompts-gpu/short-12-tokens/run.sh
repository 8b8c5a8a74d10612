# shorter prompts (12 random tokens), Qwen3 shape at 12 GiB: the plan's threshold (16: these prompts on the CPU) against 8 (on the GPU)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 12 --random-prompts 8 --ctx 4096 -n 32 --rounds 2 --prefill-reps 3 --row-env GGML_OP_OFFLOAD_MIN_BATCH=16,8 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((290 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -8 $OUT/a.err
grep -E "^\| 12 GiB" $OUT/a.md | head; grep "first request alone\|round by round" $OUT/a.md; echo "total $SECONDS s"
