# Call 6a (issue 72): the slots on a Vulkan device, first light on the GPU machine. The Vulkan build of this tree on
# the NVIDIA driver (Debian 12's loader, headers and glslc carried: vulkan.sh), packed for call 6b; the device
# llama.cpp lists; test-backend-ops' negative expert id cases (patch 0028) on Vulkan0 against the CPU; the
# Qwen3-30B-A3B shape, its profile and serve_bench's other preparations for call 6b.
# Question: do the Vulkan shaders give exact zeros for negative ids on a real GPU (lavapipe passes them in CI)?
# Debian 12's glslc has no cooperative-matrix nor integer-dot extensions: this build runs Vulkan's plain shaders on
# the H100, as both sides of call 6b do.
# Carry: .carry (the sdist), .whl, .gl and .vk (prepare.sh, then prepare.sh --vulkan). About 9 minutes.
source native/bench/device/setup.sh || exit 1
source native/bench/device/vulkan.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t=$SECONDS; VBIN=$(vulkan_bin_dir) || exit 1; echo "VBIN=$VBIN build $((SECONDS-t)) s"
$VBIN/llama-server --list-devices 2>&1 | tee $OUT/devices.txt | grep -E "Vulkan|Available"
VID=$(basename $(dirname $VBIN))
t=$SECONDS; tar c -C ~/.local/share/moeplug/builds $VID | xz -T16 -6 | split -b 15M - $OUT/vkbuild.txz.; echo "pack $((SECONDS-t)) s"; ls -la $OUT
for op in MUL_MAT_ID_SKIP_NEG ADD_ID_SKIP_NEG MUL_MAT_VEC_FUSION_SKIP_NEG; do
    timeout 120 $VBIN/test-backend-ops -b Vulkan0 -o $op > $OUT/ops-$op.txt 2>&1; echo "$op rc=$? $(grep -E 'tests passed' $OUT/ops-$op.txt)"
done
t=$SECONDS; timeout $((570 - SECONDS)) python3 native/bench/serve_bench.py --shape qwen3-30b-a3b --build-only \
    --prebuilt-moeplug $VBIN --prebuilt-stock $VBIN > $OUT/prepare.txt 2>&1; echo "prepare rc=$? $((SECONDS-t)) s"
tail -3 $OUT/prepare.txt; echo "total $SECONDS s"
