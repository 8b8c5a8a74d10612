# call D: why a chat's first turn prefills below stock (0.82x for 44 tokens): the plan's dynamic slots against the same
# plan's static (profile) slots, Qwen3 shape at 12 GiB, chat turns; then 44-token random prompts (flat routing:
# the slots' fit does not matter there, so what is left is the path's own cost)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads chat --ctx 8192 -n 32 --rounds 2 --policies dynamic,static --prebuilt-moeplug $BIN --prebuilt-stock $BIN --keep-logs $OUT/logs --time-limit $((330 - SECONDS)) --json $OUT/chat.json > $OUT/chat.md 2> $OUT/chat.err; echo "chat rc=$? $SECONDS s"; tail -3 $OUT/chat.err
grep -E "^\| 12 GiB" $OUT/chat.md | head
python3 native/bench/serve_bench.py --model /tmp/moeplug-bench/qwen3-30b-a3b-shape.gguf --budgets 12 --workloads random --random-tokens 44 --random-prompts 6 --ctx 4096 -n 16 --rounds 2 --prefill-reps 3 --policies dynamic,static --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((560 - SECONDS)) --json $OUT/r44.json > $OUT/r44.md 2> $OUT/r44.err; echo "r44 rc=$? $SECONDS s"; tail -3 $OUT/r44.err
grep -E "^\| 12 GiB" $OUT/r44.md | head; grep "first request alone" -A3 $OUT/r44.md | head; echo "total $SECONDS s"
