# Call 6b (issue 72): what moeplug serves on a Vulkan GPU against stock llama.cpp's Vulkan --fit at the same budget.
# serve_bench of the Qwen3-30B-A3B shape at 12 GiB on the Vulkan build of call 6a (NVIDIA driver), text and random
# prompts, 64 generated tokens, two rounds: moeplug's plan (slots static or dynamic, the CPU computing each layer's
# misses beside them; no streamed misses, copies ahead nor short-prompt flag on Vulkan, which the plan's notes say)
# against stock's flags `--fit on` on the same binary (the patches are opt-in).
# Question: does the slot cache gain on a Vulkan GPU as on CUDA (CUDA at 12 GiB: decode 1.29x, prefill 1.10x)?
# Carry: .carry (call 6a's vkbuild.txz.*; not the sdist), .whl, .gl and .vk. About 9 minutes on a warm machine.
source native/bench/device/setup.sh || exit 1
source native/bench/device/vulkan.sh || exit 1
if ls .carry/vkbuild.txz.* > /dev/null 2>&1; then
    mkdir -p ~/.local/share/moeplug/builds && cat .carry/vkbuild.txz.* | xz -d | tar x -C ~/.local/share/moeplug/builds
fi
t=$SECONDS; VBIN=$(vulkan_bin_dir) || exit 1; echo "VBIN=$VBIN $((SECONDS-t)) s"
timeout $((590 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 12 --workloads text,random \
    --max-prompts 8 -n 64 --rounds 2 --prebuilt-moeplug $VBIN --prebuilt-stock $VBIN --time-limit $((575 - SECONDS)) \
    --json $OUT/vulkan-12gib.json > $OUT/vulkan-12gib.md 2> $OUT/vulkan-12gib.err; echo "serve_bench rc=$? $SECONDS s"
tail -3 $OUT/vulkan-12gib.err; grep -E "^\| 12 GiB|round by round|first request alone" $OUT/vulkan-12gib.md
grep -h "moe-cache:" ~/.local/state/moeplug/logs/*.log 2>/dev/null | sort | uniq -c | head -4; echo "total $SECONDS s"
