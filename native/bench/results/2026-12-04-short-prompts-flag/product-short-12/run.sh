# call C: the product path with the flag (planner revision 3): Qwen3 shape, moeplug install at 12 GiB, then
# moeplug bench --chat --short 12 (held-out text, chat turns, every prompt cut to 12 tokens)
source .carry/setup.sh; BIN=$(bin_dir); CAR=$(basename $(dirname $BIN))
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
echo "carried $CAR resolved $BID"
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
t=$SECONDS; python3 -m moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null; echo "model rc=$? $((SECONDS-t)) s"
t=$SECONDS; python3 -m moeplug install /tmp/qwen3-shape.gguf --no-serve --vram-budget 12GiB --ctx 8192 --profile-tokens 64 > $OUT/install.txt 2>&1; echo "install rc=$? $((SECONDS-t)) s"; grep -i "offload-min-batch\|environment" $OUT/install.txt | head -3
NAME=$(python3 -m moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])"); echo "NAME=$NAME"
t=$SECONDS; python3 -m moeplug bench $NAME --rounds 2 --chat --short 12 --json > $OUT/bench.json 2> $OUT/bench.err; echo "bench rc=$? $((SECONDS-t)) s"; tail -3 $OUT/bench.err
python3 - $OUT/bench.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("moeplug args has flag:", "--moe-cache-offload-min-batch" in d["sides"]["moeplug"]["args"], "env", d["sides"]["moeplug"].get("env"))
print("vram", d["sides"]["moeplug"]["vram_bytes"], d["sides"]["stock"]["vram_bytes"])
for w, v in d.get("workloads", {}).items():
    for k in ("prefill", "first", "decode"):
        s = v.get(k) or {}
        print(w, k, "median", s.get("ratio_median"), "lowest", s.get("ratio_lowest"), "interval", s.get("ratio_interval"))
print("notes", d.get("notes"))
PY
cp ~/.local/state/moeplug/logs/*.log $OUT/ 2>/dev/null; echo "total $SECONDS s"
