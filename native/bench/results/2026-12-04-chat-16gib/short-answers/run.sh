# `short-answers/`: short answers apart (16 decoding steps after a new prompt, on the slots another
# prompt left) beside whole answers of 64 tokens; Qwen3 shape at 12 GiB, held-out and profiled text (6 prompts
# each) and 44-token random prompts, three rounds
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads text,random --max-prompts 6 --random-tokens 44 --random-prompts 6 --ctx 4096 -n 64 --rounds 3 --prefill-reps 3 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/short.json > $OUT/short.md 2> $OUT/short.err; echo "short rc=$? $SECONDS s"; tail -3 $OUT/short.err
grep -E "^\| 12 GiB" $OUT/short.md | head; grep -E "short answers|first request alone|95% interval" $OUT/short.md; echo "total $SECONDS s"
