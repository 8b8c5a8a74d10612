# short prompts (24 random tokens: below llama.cpp's offload threshold of 32), Qwen3 shape at 12 GiB: the misses of a
# short prompt batch on the CPU (the plan), with a share on the GPU (--moe-cache-stream 0.5), or the whole batch through
# the prompt path (GGML_OP_OFFLOAD_MIN_BATCH=16: the missed experts copied to the GPU)
source .carry/setup.sh; BIN=$(bin_dir); echo "BIN=$BIN"
python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads random --random-tokens 24 --random-prompts 8 --ctx 8192 -n 32 --rounds 3 --prefill-reps 3 --stream-shares 0,0.5 --row-env GGML_OP_OFFLOAD_MIN_BATCH=unset,16 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --time-limit $((550 - SECONDS)) --json $OUT/a.json > $OUT/a.md 2> $OUT/a.err; echo "rc=$?"; tail -14 $OUT/a.err
grep -E "^\| (8|12) GiB" $OUT/a.md | head -20; echo "total $SECONDS s"
