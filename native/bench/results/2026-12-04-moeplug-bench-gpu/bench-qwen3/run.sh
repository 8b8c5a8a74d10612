# moeplug bench on the H200 through the product path: Qwen3 shape at 12 GiB, text prompts, a chat, long prompts
source .carry/setup.sh; BIN=$(bin_dir); CAR=$(basename $(dirname $BIN))
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
echo "carried $CAR resolved $BID"
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
t=$SECONDS; python3 -m moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null; echo "model rc=$? $((SECONDS-t)) s"
t=$SECONDS; python3 -m moeplug install /tmp/qwen3-shape.gguf --no-serve --vram-budget 12GiB --ctx 8192 --profile-tokens 64 > $OUT/install.txt 2>&1; echo "install rc=$? $((SECONDS-t)) s"; tail -3 $OUT/install.txt
NAME=$(python3 -m moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])"); echo "NAME=$NAME"
t=$SECONDS; python3 -m moeplug bench $NAME --rounds 2 --chat --prompt-tokens 4096 --json > $OUT/bench.json 2> $OUT/bench.err; echo "bench rc=$? $((SECONDS-t)) s"; tail -5 $OUT/bench.err
python3 - $OUT/bench.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for w, v in d.get("workloads", {}).items():
    for k in ("prefill", "first", "decode"):
        s = v.get(k) or {}
        print(w, k, "median", s.get("ratio_median"), "lowest", s.get("ratio_lowest"), "interval", s.get("ratio_interval"))
print("notes", d.get("notes"))
PY
cp ~/.local/state/moeplug/logs/*.log $OUT/ 2>/dev/null; echo "total $SECONDS s"
