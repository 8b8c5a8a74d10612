# Call B (issue 68 on the GPU machine), after call A on the same warm machine: `moeplug install` of the Qwen3-30B-A3B
# shape at 12 GiB from a fresh home, as a user gets it: calibrated with the model itself (three GPU runs: the CPU's
# rate and the round trip each from what isolates it), planned, and checked by running the plan, the plan made with
# the fitted figures and stock's placement side by side on held-out prompts; the fastest served.
# BUDGET=8 bash ... for 8 GiB. Carry: .carry (call A's build.txz.*) and .whl. About 6 minutes.
source native/bench/device/setup.sh || exit 1
B=${BUDGET:-12}; R=/tmp/call-b-$B; mkdir -p $R; pack() { tar czf $OUT/results-b-$B.tgz -C $R .; }
t=$SECONDS; BIN=$(bin_dir) || exit 1; CAR=$(basename $(dirname $BIN)); echo "BIN=$BIN $((SECONDS-t)) s"
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
[ -f /tmp/qwen3-shape.gguf ] || { t=$SECONDS; moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null; echo "model $((SECONDS-t)) s"; }
export XDG_DATA_HOME=/tmp/home-$B/data XDG_STATE_HOME=/tmp/home-$B/state XDG_CONFIG_HOME=/tmp/home-$B/config
mkdir -p $XDG_DATA_HOME/moeplug && ln -sfn ~/.local/share/moeplug/builds $XDG_DATA_HOME/moeplug/builds
t=$SECONDS; timeout $((585 - SECONDS)) moeplug install /tmp/qwen3-shape.gguf --no-serve --vram-budget ${B}GiB --ctx 8192 \
    > $R/install.txt 2> $R/install.err; echo "install rc=$? $((SECONDS-t)) s"
cp $XDG_DATA_HOME/moeplug/installed/*.json $R/ 2>/dev/null; cp $XDG_DATA_HOME/moeplug/calibration/*.json $R/calibration.json 2>/dev/null; pack
grep -E "calibrating|CPU beside|round trip|bus:|uploads|checking|one launch|within|decode" $R/install.err | head -20
sed -n '/^check/,$p' $R/install.txt | head -20; tail -3 $R/install.err
echo "total $SECONDS s"
