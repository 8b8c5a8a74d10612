# Stock's flags on the patched build against the unpatched build's (call C): `moeplug bench --rounds 3
# --stock-binary patched` of the plan call B installed at 12 GiB, on the same warm machine right after call C.
source native/bench/device/setup.sh >/dev/null 2>&1; export XDG_DATA_HOME=/tmp/home-12/data XDG_STATE_HOME=/tmp/home-12/state XDG_CONFIG_HOME=/tmp/home-12/config; t=$SECONDS; timeout 300 moeplug bench qwen3-shape --rounds 3 --stock-binary patched --json > $OUT/bench-patched-12.json 2> $OUT/bench-patched-12.err; echo "rc=$? $((SECONDS-t)) s"; python3 -c "
import json; d=json.load(open('$OUT/bench-patched-12.json')); t=d['workloads']['text']
print('stock side', d['stock_build'])
for k in ('prefill','decode'): print(k, t[k]['ratio_median'], t[k]['ratio_lowest'], t[k]['ratio_interval'])
print(t['per_round'])"
