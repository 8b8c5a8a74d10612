# `decode-64-tokens/`: are the two decode readings below stock in run `2026-12-04-chat-opening-turns`'s -n 16 runs
# (6-token prompts with --moe-cache-offload-min-batch 4: 0.96x; 44 random tokens on the plan: 0.94x) a per-request
# cost that 16 generated tokens magnify? The same rows with 64 generated tokens, three rounds; Qwen3 shape at 12 GiB
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
timeout $((340 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 6 --random-prompts 6 --ctx 4096 -n 64 --rounds 3 --prefill-reps 3 --row-args 'none;--moe-cache-offload-min-batch 4' --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((320 - SECONDS)) --json $OUT/r6.json > $OUT/r6.md 2> $OUT/r6.err; echo "r6 rc=$? $SECONDS s"; tail -3 $OUT/r6.err
grep -E "^\| 12 GiB" $OUT/r6.md | head; grep -E "first request alone|round by round|95% interval" $OUT/r6.md
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --model /tmp/moeplug-bench/qwen3-30b-a3b-shape.gguf --budgets 12 --workloads random --random-tokens 44 --random-prompts 6 --ctx 4096 -n 64 --rounds 3 --prefill-reps 2 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/r44.json > $OUT/r44.md 2> $OUT/r44.err; echo "r44 rc=$? $SECONDS s"; tail -3 $OUT/r44.err
grep -E "^\| 12 GiB" $OUT/r44.md | head; grep -E "first request alone|round by round|95% interval" $OUT/r44.md; echo "total $SECONDS s"
