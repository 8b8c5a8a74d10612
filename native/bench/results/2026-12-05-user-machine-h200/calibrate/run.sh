# Call A (issue 65 on the GPU machine): the CUDA build of this tree, packed for the next calls; `moeplug calibrate`
# at 16 and 8 cores against the fitted CostModel with the plans each gives (call 5's script).
# Carry: .carry (sdist, trace) and .whl, from native/bench/device/prepare.sh. About 8 minutes.
# At most 8 files come back from $OUT: the build's pieces go there, everything else into /tmp/call-a, packed into
# $OUT/results-a.tgz after each step (so a call stopped at its limit still returns what was done).
source native/bench/device/setup.sh || exit 1
R=/tmp/call-a; mkdir -p $R; pack() { tar czf $OUT/results-a.tgz -C $R .; }
t=$SECONDS; BIN=$(bin_dir) || exit 1; echo "BIN=$BIN build $((SECONDS-t)) s"
CAR=$(basename $(dirname $BIN))
t=$SECONDS; tar c -C ~/.local/share/moeplug/builds $CAR | xz -T16 -6 | split -b 15M - $OUT/build.txz.; echo "pack $((SECONDS-t)) s"
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
echo "carried $CAR resolved $BID"
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
OUT=$R bash native/bench/device/queue/5-calibrate.sh  # now calibrate.sh beside this file 2>&1 | grep -v "^BIN=" | tee $R/calibrate.txt; pack
echo "total $SECONDS s"
