# Call C (issue 68 on the GPU machine), after call B on the same warm machine: `moeplug bench --rounds 3` of what
# the install served at 12 GiB, against stock --fit at the same budget on the unpatched build of the pin (bench's
# default): is what the check chose at least as fast as the best of its candidates, within noise?
# BUDGET=8 bash ... for 8 GiB. Carry as call B. About 7 minutes.
source native/bench/device/setup.sh || exit 1
B=${BUDGET:-12}; R=/tmp/call-c-$B; mkdir -p $R; pack() { tar czf $OUT/results-c-$B.tgz -C $R .; }
export XDG_DATA_HOME=/tmp/home-$B/data XDG_STATE_HOME=/tmp/home-$B/state XDG_CONFIG_HOME=/tmp/home-$B/config
NAME=$(moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])") || exit 1
moeplug list
t=$SECONDS; timeout $((585 - SECONDS)) moeplug bench $NAME --rounds 3 --json > $R/bench.json 2> $R/bench.err
echo "bench rc=$? $((SECONDS-t)) s"; tail -2 $R/bench.err; pack
python3 - $R/bench.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("stock side", d.get("stock_build"))
for w, v in d.get("workloads", {}).items():
    for k in ("prefill", "decode"):
        s = v.get(k) or {}
        print(w, k, "median", s.get("ratio_median"), "lowest", s.get("ratio_lowest"), "interval", s.get("ratio_interval"))
    for side, r in v.get("per_round", {}).items():
        print(" ", side, "per round", r)
PY
echo "total $SECONDS s"
