# call E: a chat's first turns with the previous conversation's answers as long as the product path's (-n 64), three
# rounds: the plan's half-life (32 tokens) against 96 (slots that keep more of what was hot before the last answer)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads chat --ctx 8192 -n 64 --rounds 3 --row-args 'none;--moe-cache-half-life 96' --prebuilt-moeplug $BIN --prebuilt-stock $BIN --keep-logs $OUT/logs --time-limit $((560 - SECONDS)) --json $OUT/chat.json > $OUT/chat.md 2> $OUT/chat.err; echo "chat rc=$? $SECONDS s"; tail -3 $OUT/chat.err
grep -E "^\| 12 GiB" $OUT/chat.md | head; tar czf $OUT/logs.tgz -C $OUT logs && rm -r $OUT/logs; echo "total $SECONDS s"
