# four prompts at once, Qwen3 shape at 8 and 12 GiB: the GPU computing a share of the misses (--moe-cache-stream 0, 0.5, 0.75)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12,8 --workloads concurrent --streams 4 --ctx 8192 -n 64 --rounds 3 --stream-shares 0,0.5,0.75 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((550 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -12 $OUT/a.err
grep -E "^\| (8|12) GiB" $OUT/a.md | head -20; echo "total $SECONDS s"
