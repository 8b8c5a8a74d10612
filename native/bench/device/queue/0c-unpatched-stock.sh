# Call 0c (issue "On the GPU machine when it is lent", run 1: stock means stock), what is left of it: run
# 2026-12-07-install-chooses-h100 ran the 12 GiB plan's three-round bench against both stock sides on an H100 (the
# unpatched build 112-115 t/s a round, stock's flags on the patched build 109-117), and the 8 GiB plan against the
# unpatched build only. This call: at 8 GiB, the install from a fresh home and both benches back to back, so that
# the two stock sides meet the same plan on the same warm machine.
# Needs both CUDA builds: carry .carry with a packed patched build (build.txz.*, from a call of
# native/bench/results/2026-12-07-install-chooses-h100/builds/run.sh) and .whl; the unpatched build is made here
# (about 4 minutes) when missing. About 10 minutes: past the call's limit, the second bench is cut (what ran comes back).
source native/bench/device/setup.sh || exit 1
R=/tmp/call-0c; mkdir -p $R; pack() { tar czf $OUT/results-0c.tgz -C $R .; }
t=$SECONDS; BIN=$(bin_dir) || exit 1; CAR=$(basename $(dirname $BIN)); echo "BIN=$BIN $((SECONDS-t)) s"
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
t=$SECONDS; SBIN=$(bin_dir --stock) || exit 1; echo "stock BIN=$SBIN $((SECONDS-t)) s"
[ -f /tmp/qwen3-shape.gguf ] || moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null
export XDG_DATA_HOME=/tmp/home-0c/data XDG_STATE_HOME=/tmp/home-0c/state XDG_CONFIG_HOME=/tmp/home-0c/config
mkdir -p $XDG_DATA_HOME/moeplug && ln -sfn ~/.local/share/moeplug/builds $XDG_DATA_HOME/moeplug/builds
t=$SECONDS; moeplug install /tmp/qwen3-shape.gguf --no-serve --vram-budget 8GiB --ctx 8192 > $R/install.txt 2> $R/install.err
echo "install rc=$? $((SECONDS-t)) s"; sed -n '/^check/,$p' $R/install.txt; pack
for side in stock patched; do
    t=$SECONDS; timeout $((590 - SECONDS)) moeplug bench qwen3-shape --rounds 3 --stock-binary $side --json > $R/bench-$side.json \
        2> $R/bench-$side.err; echo "bench $side rc=$? $((SECONDS-t)) s"; pack
    python3 -c "
import json, sys
d = json.load(open('$R/bench-$side.json')); t = d['workloads']['text']
for k in ('prefill', 'decode'): print('$side', k, t[k]['ratio_median'], t[k]['ratio_lowest'], t[k]['ratio_interval'])
print('$side per round', t['per_round'])" 2>/dev/null
done
echo "total $SECONDS s"
