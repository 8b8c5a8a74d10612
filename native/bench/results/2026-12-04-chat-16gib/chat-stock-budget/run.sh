# `chat-stock-budget/`: the chat's opening turns at 16 GiB against stock --fit as users run it (-fitt from the
# budget: it holds ~178 MiB more) and against stock held to the budget (-fitt raised until NVML shows no more than
# 16 GiB); Qwen3 shape, the plan, -n 64, three rounds
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 16 --workloads chat --ctx 8192 -n 64 --rounds 3 --stock-vram fit,budget --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/chat.json > $OUT/chat.md 2> $OUT/chat.err; echo "chat rc=$? $SECONDS s"; tail -3 $OUT/chat.err
grep -E "^\| 16 GiB" $OUT/chat.md | head; grep -E "opening|round by round|95% interval|fitt" $OUT/chat.md; grep -i "fitt\|holds" $OUT/chat.err | head -5; echo "total $SECONDS s"
