# `threshold-4/`: the threshold-4 row alone against stock, with the servers' logs and the scheduler's
# timeline (GGML_SCHED_TIMELINE=64), to see where its slow processes lose time; 6 random tokens, -n 32, two rounds
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
timeout $((228 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 6 --random-prompts 6 --ctx 4096 -n 32 --rounds 2 --prefill-reps 2 --row-args '--moe-cache-offload-min-batch 4' --env GGML_SCHED_TIMELINE=64 --keep-logs $OUT/logs --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((222 - SECONDS)) --json $OUT/r6.json > $OUT/r6.md 2> $OUT/r6.err; echo "r6 rc=$? $SECONDS s"; tail -3 $OUT/r6.err
grep -E "^\| 12 GiB|round by round" $OUT/r6.md; tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs; echo "total $SECONDS s"
