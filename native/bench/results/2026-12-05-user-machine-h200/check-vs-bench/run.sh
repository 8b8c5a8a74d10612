# Call B (issue 65 on the GPU machine): the product path after call A: `moeplug install` of the Qwen3-30B-A3B shape
# at 12 GiB, whose check (on by default with a GPU: one round, three held-out prompts, stock's flags on the same
# build) gives its verdict, then `moeplug bench` of the same plan, three rounds, against the same stock side:
# does the one-round check point the same way as three rounds?
# Carry: .carry (call A's build.txz.*, the trace) and .whl. About 5 minutes on call A's warm machine.
source native/bench/device/setup.sh || exit 1
R=/tmp/call-b; mkdir -p $R; pack() { tar czf $OUT/results-b.tgz -C $R .; }
t=$SECONDS; BIN=$(bin_dir) || exit 1; CAR=$(basename $(dirname $BIN)); echo "BIN=$BIN $((SECONDS-t)) s"
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
[ -f /tmp/qwen3-shape.gguf ] || { t=$SECONDS; moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null; echo "model $((SECONDS-t)) s"; }
t=$SECONDS; timeout $((400 - SECONDS)) moeplug install /tmp/qwen3-shape.gguf --no-serve --vram-budget 12GiB --ctx 8192 \
    > $R/install.txt 2>&1; echo "install rc=$? $((SECONDS-t)) s"; grep -E "here:|serving stock|calibrat" $R/install.txt; pack
NAME=$(moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])")
moeplug list --json | python3 -c "import json,sys; m=json.load(sys.stdin)['models'][0]; print('verdict', m.get('verdict'))"
t=$SECONDS; timeout $((590 - SECONDS)) moeplug bench $NAME --rounds 3 --stock-binary patched --json > $R/bench.json \
    2> $R/bench.err; echo "bench rc=$? $((SECONDS-t)) s"; tail -2 $R/bench.err; pack
python3 - $R/bench.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for w, v in d.get("workloads", {}).items():
    for k in ("prefill", "decode"):
        s = v.get(k) or {}
        print(w, k, "median", s.get("ratio_median"), "lowest", s.get("ratio_lowest"))
PY
echo "total $SECONDS s"
