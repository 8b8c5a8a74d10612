# Call D (issue 62 on the GPU machine): one H200 plus a CPU-backed rpc-server on the same box (moeplug rpc-server on
# 127.0.0.1, 8 threads), the Qwen3-30B-A3B shape planned at 12 GiB on the GPU with 16 GiB on the remote device,
# the hop measured first (calibrate --rpc); then `moeplug bench` of that plan against stock's split over the same
# devices (--rpc, --fit with a -fitt per device), two rounds, stock's flags on the same build. The remote device here
# computes on this box's CPU, beside the server's own threads: a check that the path runs on CUDA, not a figure
# for a second PC's GPU.
# Carry: .carry (call A's build.txz.*) and .whl. About 6 minutes on a warm machine.
source native/bench/device/setup.sh || exit 1
R=/tmp/call-d; mkdir -p $R; pack() { tar czf $OUT/results-d.tgz -C $R .; }
BIN=$(bin_dir) || exit 1; CAR=$(basename $(dirname $BIN))
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
[ -f /tmp/qwen3-shape.gguf ] || { t=$SECONDS; moeplug dev make-model --shape qwen3-30b-a3b --out /tmp/qwen3-shape.gguf > /dev/null; echo "model $((SECONDS-t)) s"; }
CUDA_VISIBLE_DEVICES= setsid moeplug rpc-server --host 127.0.0.1 --port 50052 --threads 8 > $R/rpc-server.txt 2>&1 &
sleep 5; cat $R/rpc-server.txt
t=$SECONDS; timeout 120 moeplug calibrate /tmp/qwen3-shape.gguf --rpc 127.0.0.1:50052 --json > $R/calibrate-rpc.json 2> $R/calibrate-rpc.err
echo "calibrate rc=$? $((SECONDS-t)) s"; python3 -c "import json; d=json.load(open('$R/calibrate-rpc.json')); print('hop', d.get('rpc_hop_s'), 'cpu', d.get('cpu_expert_bytes_per_s'))"
t=$SECONDS; timeout 200 moeplug install /tmp/qwen3-shape.gguf --no-serve --no-check --vram-budget 12GiB --rpc 127.0.0.1:50052 \
    --rpc-budget 16GiB --ctx 8192 > $R/install.txt 2>&1; echo "install rc=$? $((SECONDS-t)) s"; grep -E "^RPC|^CUDA|server args|^note" $R/install.txt; pack
NAME=$(moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])")
t=$SECONDS; timeout $((590 - SECONDS)) moeplug bench $NAME --rounds 2 --stock-binary patched --json > $R/bench.json \
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
