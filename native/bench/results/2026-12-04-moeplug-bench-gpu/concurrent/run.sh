# four prompts at once, Qwen3 shape at 8, 12 and 16 GiB
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 8,12,16 --workloads concurrent --streams 4 --ctx 8192 -n 64 --rounds 2 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((540 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -3 $OUT/a.err
grep -A6 "^### concurrent" $OUT/a.md | head -30
