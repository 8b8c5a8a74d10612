# Call 2: the same A/B on real routing: gpt-oss-20b shape at 25% of expert bytes, the trace cut prepare.sh writes
# (profiled on its prompts 0-249, replaying 250-254), 96 tokens per prompt, two rounds.
# Question (issues 19 and 23): on the routing the targets are set on, does LLAMA_MOE_CACHE_DIRECT=1 raise decode
# over the plan as it is (1.37x-1.59x of stock in runs `2026-12-04-chat-opening-turns` and `2026-12-02-stream-share`)? gpt-oss experts are
# MXFP4, 0.24 ms a miss on the bus against 0.36-0.43 ms streamed now (DESIGN.md).
# Carry: .carry (build.txz.* from call 1, the trace; not the sdist: 64 MiB) and .whl. About 8 minutes.
source native/bench/device/setup.sh || exit 1
BIN=$(bin_dir) || exit 1; echo "BIN=$BIN"
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --shape gpt-oss-20b --budgets 25% --workloads replay --trace .carry/trace-0-250-400-410.npz --train-prompts 0:250 --replay-prompts 250:260 --max-prompts 5 -n 96 --rounds 2 --row-env LLAMA_MOE_CACHE_DIRECT=unset,1 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/replay.json > $OUT/replay.md 2> $OUT/replay.err; echo "replay rc=$? $SECONDS s"; tail -3 $OUT/replay.err
grep -E "^\| 25%|round by round|first request alone" $OUT/replay.md; echo "total $SECONDS s"
