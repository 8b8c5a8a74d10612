# Run `2026-12-05-cpu-after-answer`, on the development machine (2 cores, no GPU: the device was not lent): does the CPU build
# show moeplug's slow prompt right after a decoded answer (run `2026-12-04-chat-16gib`, H200: 89% of its 6-token prefills
# after an answer 15 ms or more over the prompt's fastest, 6% after a one-token request; stock 17% and 11%)?
# A small qwen3moe synthetic model, slots in RAM (serve_bench's CPU mode), both sides on the patched build (stock
# flags: the patches are opt-in), run `2026-12-04-chat-16gib`'s 6-token workload otherwise.
BIN=~/.local/share/moeplug/builds/b11434-cpu-moeplug-0d91eaee10b5/bin
moeplug dev make-model --out /tmp/exp/m.gguf --arch qwen3moe --layers 8 --experts 64 --used 8 --embd 512 --expert-ff 768 --dtype q8_0 --expert-dtype q8_0
python native/bench/serve_bench.py --model /tmp/exp/m.gguf --backend cpu --budgets 1 --workloads random --random-tokens 6 --random-prompts 6 --ctx 2048 -n 64 --rounds 2 --prefill-reps 3 --prebuilt-moeplug $BIN --prebuilt-stock $BIN --json r6.json > r6.md 2> r6.err
