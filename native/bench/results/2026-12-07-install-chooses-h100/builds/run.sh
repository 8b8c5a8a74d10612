# Call A (issue 68 on the GPU machine): the CUDA builds the next calls run, the patched one packed into
# $OUT/build.txz.* (copy them into .carry/ for a call that finds a cold machine), then the unpatched build of the pin
# that `moeplug bench` runs stock's side on (left on the machine: calls B and C follow while it is warm).
# Carry: .carry (sdist) and .whl. About 9 minutes.
source native/bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
t=$SECONDS; BIN=$(bin_dir) || exit 1; echo "BIN=$BIN build $((SECONDS-t)) s"
CAR=$(basename $(dirname $BIN))
t=$SECONDS; tar c -C ~/.local/share/moeplug/builds $CAR | xz -T16 -6 | split -b 15M - $OUT/build.txz.; echo "pack $((SECONDS-t)) s"; ls -la $OUT
t=$SECONDS; SBIN=$(timeout $((590 - SECONDS)) bash -c 'source native/bench/device/setup.sh >/dev/null && bin_dir --stock') || exit 1
echo "stock BIN=$SBIN build $((SECONDS-t)) s"; echo "total $SECONDS s"
