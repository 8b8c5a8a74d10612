# four prompts at once, Qwen3 shape at 12 GiB, the group's decode over the wall time it waited
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads concurrent --streams 4 --ctx 8192 -n 64 --rounds 2 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((150 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -3 $OUT/a.err
grep "^| 12" $OUT/a.md | head
