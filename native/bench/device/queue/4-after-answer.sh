# Call 4 (issue 19): why does a new prompt right after a long answer prefill slower on moeplug (first requests
# 0.75x-0.87x of stock, run `2026-12-04-chat-16gib`; 89% of its 6-token prefills after an answer 15 ms or more over the
# prompt's fastest, 6% after a one-token request; stock 17% and 11%)? The CPU build shows nothing of it (thirty-
# run `2026-11-30-planner-placement`: 0% and 0%), so the suspect is the GPU side: ggml-cuda keys a CUDA graph by its split's first node,
# a 6-token prompt and a decoded token share the keys, and back-to-back prompts of one shape (the repeats) may
# replay captured graphs while a prompt after decoded tokens launches every kernel of every split itself.
# Two runs of the Qwen3 shape at 12 GiB, 6 random tokens, -n 64, three requests per prompt, every graph timed
# (GGML_SCHED_TIMELINE=1): as is, and with CUDA graphs off on both sides (GGML_CUDA_DISABLE_GRAPHS=1); then
# `timeline.py --prompts` on each run's logs: server prompt time against the host's time in splits, after an answer
# against after a one-token request, and the splits that differ.
# TOKENS=44 bash ... runs the same for 44-token prompts, which take the GPU path (first requests 0.75x of stock on
# random tokens, run `2026-12-04-chat-16gib`): call 5. Carry as call 2. About 9 minutes each.
source native/bench/device/setup.sh || exit 1
BIN=$(bin_dir) || exit 1; echo "BIN=$BIN"
tokens=${TOKENS:-6}
for run in graphs nographs; do
    env=GGML_SCHED_TIMELINE=1; end=300; rm -rf /tmp/logs-$run
    [ $run = nographs ] && env=$env,GGML_CUDA_DISABLE_GRAPHS=1 && end=585
    timeout $((end - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens $tokens --random-prompts 6 --ctx 4096 -n 64 --rounds 1 --prefill-reps 3 --env $env --keep-logs /tmp/logs-$run --prebuilt-moeplug $BIN --prebuilt-stock $BIN --json $OUT/$run.json > $OUT/$run.md 2> $OUT/$run.err; echo "$run rc=$? $SECONDS s"; tail -2 $OUT/$run.err
    grep -E "^\| 12 GiB|more than 15 ms|first request alone" $OUT/$run.md
    python3 native/bench/timeline.py --prompts /tmp/logs-$run/*.log > $OUT/$run-prompts.txt; grep -E "^\| $tokens |^##|split" $OUT/$run-prompts.txt | head -24
done
echo "total $SECONDS s"
