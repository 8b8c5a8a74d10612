# Call 3: issue 23's target with the misses read in place: gpt-oss-20b shape at 25%, the small draft model, 3 draft
# tokens at acceptance 0.7, against stock --fit with the same draft and without speculation (--spec-baseline).
# Question: does moeplug + draft reach 2.0x of stock without speculation (1.26x in run `2026-12-04-chat-opening-turns`, 1.50x
# with streaming in the seventeenth)? A verification batch of 4 tokens reads each (token, expert) pair in place
# (about 6.2 pairs a layer against 4.76 distinct experts): the run says whether that costs more than it saves.
# Carry as call 2. About 9 minutes.
source native/bench/device/setup.sh || exit 1
BIN=$(bin_dir) || exit 1; echo "BIN=$BIN"
timeout $((585 - SECONDS)) python3 native/bench/serve_bench.py --shape gpt-oss-20b --budgets 25% --workloads replay --trace .carry/trace-0-250-400-410.npz --train-prompts 0:250 --replay-prompts 250:260 --max-prompts 5 -n 96 --rounds 2 --spec draft:small --spec-draft-max 3 --spec-accept 0.7 --spec-baseline --row-env LLAMA_MOE_CACHE_DIRECT=unset,1 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((570 - SECONDS)) --json $OUT/spec.json > $OUT/spec.md 2> $OUT/spec.err; echo "spec rc=$? $SECONDS s"; tail -3 $OUT/spec.err
grep -E "^\| 25%|^\| vs|round by round|accepted" $OUT/spec.md; echo "total $SECONDS s"
