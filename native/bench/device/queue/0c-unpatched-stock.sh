# Call C (issue 65 on the GPU machine): stock means stock. The unpatched CUDA build of the pin (built here, about
# 4 minutes), then `moeplug bench` of the Qwen3-30B-A3B shape installed at 12 GiB by call B, three rounds, stock's
# side on the unpatched build (bench's default): beside call B's bench of the same plan against stock's flags on
# the patched build, it says whether the earlier tables (stock's flags on the patched binary) measured stock.
# Carry: .carry (call A's build.txz.*, the trace; not the sdist) and .whl. About 9 minutes on a warm machine.
source native/bench/device/setup.sh || exit 1
t=$SECONDS; BIN=$(bin_dir) || exit 1; CAR=$(basename $(dirname $BIN)); echo "BIN=$BIN $((SECONDS-t)) s"
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
t=$SECONDS; SBIN=$(bin_dir --stock) || exit 1; echo "stock BIN=$SBIN build $((SECONDS-t)) s"
SCAR=$(basename $(dirname $SBIN))
SID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, True, 0, None)))")
[ -e ~/.local/share/moeplug/builds/$SID ] || ln -s ~/.local/share/moeplug/builds/$SCAR ~/.local/share/moeplug/builds/$SID
[ -f /tmp/qwen3-shape.gguf ] || { t=$SECONDS; moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null; echo "model $((SECONDS-t)) s"; }
if [ -z "$(moeplug list --json | python3 -c "import json,sys; print(''.join(m['name'] for m in json.load(sys.stdin)['models']))")" ]; then
    t=$SECONDS; moeplug install /tmp/qwen3-shape.gguf --no-serve --no-check --vram-budget 12GiB --ctx 8192 > $OUT/install.txt 2>&1
    echo "install rc=$? $((SECONDS-t)) s"
fi
NAME=$(moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])")
t=$SECONDS; timeout $((590 - SECONDS)) moeplug bench $NAME --rounds 3 --json > $OUT/bench-unpatched.json \
    2> $OUT/bench-unpatched.err; echo "bench rc=$? $((SECONDS-t)) s"; tail -2 $OUT/bench-unpatched.err
python3 - $OUT/bench-unpatched.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for w, v in d.get("workloads", {}).items():
    for k in ("prefill", "decode"):
        s = v.get(k) or {}
        print(w, k, "median", s.get("ratio_median"), "lowest", s.get("ratio_lowest"))
PY
echo "total $SECONDS s"
