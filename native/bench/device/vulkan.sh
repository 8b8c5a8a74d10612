# Sourced after setup.sh by the Vulkan calls (queue/5*-vulkan-*.sh): Debian 12's Vulkan loader into / (.gl, as the
# device tool's README says), the Vulkan and SPIR-V headers, glslc and its library beside it in /tmp/vk (.vk; both from
# `prepare.sh --vulkan`), named to CMake through VULKAN_SDK, which `moeplug native build --vulkan` then trusts; the
# NVIDIA driver's Vulkan ICD where the loader does not find one. Then `vulkan_bin_dir` prints the bin/ of the
# Vulkan build of this tree, building it where missing (its progress in /tmp/native-build-vulkan.txt).
[ -d .gl ] && [ -d .vk ] || { echo "vulkan: carry .gl and .vk (native/bench/device/prepare.sh --vulkan)"; return 1; }
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
mkdir -p /tmp/vk
for f in .vk/*.deb; do dpkg -x "$f" /tmp/vk; done
mkdir -p /tmp/vk/usr/lib
ln -sf "$(ldconfig -p | sed -n 's/.*libvulkan.so.1 (libc6,x86-64) => //p' | head -1)" /tmp/vk/usr/lib/libvulkan.so
export VULKAN_SDK=/tmp/vk/usr CMAKE_PREFIX_PATH=/tmp/vk/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
export PATH=/tmp/vk/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/vk/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* > /dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi

vulkan_bin_dir() {
    python3 -m moeplug native build --vulkan --json "$@" > /tmp/native-build-vulkan.json 2> /tmp/native-build-vulkan.txt ||
        { tail -5 /tmp/native-build-vulkan.txt >&2; return 1; }
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["path"] + "/bin")' /tmp/native-build-vulkan.json
}
