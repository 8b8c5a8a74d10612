# `chat-copy-ahead/`: a chat's opening turns at 16 GiB (0.93x-0.96x of stock in run `2026-12-04-chat-opening-turns`'s
# product path): the plan (no copies ahead: few layers partly resident, the second weight copy's memory given to slots)
# against the plan made with the copies ahead; Qwen3 shape, install's 256-token profile, -n 64, three rounds
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 16 --workloads chat --ctx 8192 -n 64 --rounds 3 --copy-ahead auto,on --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/chat.json > $OUT/chat.md 2> $OUT/chat.err; echo "chat rc=$? $SECONDS s"; tail -3 $OUT/chat.err
grep -E "^\| 16 GiB" $OUT/chat.md | head; grep -E "opening|round by round|95% interval" $OUT/chat.md; echo "total $SECONDS s"
