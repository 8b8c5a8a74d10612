# Qwen3 shape at 16 GiB: the same prompts one at a time and four at once, stock on its default threads and on 8 (moeplug's plan: 8)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 16 --workloads text,concurrent --streams 4 --max-prompts 8 --stock-threads 0,8 --ctx 8192 -n 64 --rounds 2 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((420 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -3 $OUT/a.err
grep -B2 -A6 "^| budget" $OUT/a.md | grep "^| 16\|^###" | head -30
