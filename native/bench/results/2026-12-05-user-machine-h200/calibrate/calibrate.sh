# Call 5: the user's-machine figures on the GPU machine (issue 65). `moeplug calibrate` on the Qwen3-30B-A3B shape
# with the CUDA build, at the 16 cores and on 8 (taskset, -t 8: an 8-core desktop emulated), each figure beside the
# planner's fitted default (CostModel): each within ~15%, or the default corrected with this run's label. Then the
# plan at 12 GiB made with each calibration against the one made with the defaults.
# Carry: .carry (sdist, and the packed build of call 1) and .whl, from native/bench/device/prepare.sh. About 5 minutes.
source native/bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
t=$SECONDS; BIN=$(bin_dir) || exit 1; echo "BIN=$BIN build $((SECONDS-t)) s"
MODEL=/tmp/qwen3-shape.gguf
t=$SECONDS; moeplug dev make-model --shape qwen3-30b-a3b --out $MODEL > /dev/null || exit 1; echo "model $((SECONDS-t)) s"
t=$SECONDS; timeout 200 moeplug calibrate $MODEL --force --json > $OUT/calibrate-16.json 2> $OUT/calibrate-16.err
echo "calibrate 16 cores rc=$? $((SECONDS-t)) s"; tail -2 $OUT/calibrate-16.err
t=$SECONDS; timeout 200 taskset -c 0-7 moeplug calibrate $MODEL --threads 8 --force --json > $OUT/calibrate-8.json \
    2> $OUT/calibrate-8.err
echo "calibrate 8 cores rc=$? $((SECONDS-t)) s"; tail -2 $OUT/calibrate-8.err
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
from moeplug.planner.costs import DEFAULT_COSTS
out = Path(sys.argv[1])
keys = ("cpu_expert_bytes_per_s", "round_trip_s", "h2d_bytes_per_s", "prompt_upload_bytes_per_s")
defaults = {"cpu_expert_bytes_per_s": DEFAULT_COSTS.cpu_expert_bytes_per_s, "round_trip_s": DEFAULT_COSTS.round_trip_s,
            "h2d_bytes_per_s": DEFAULT_COSTS.h2d_bytes_per_s,
            "prompt_upload_bytes_per_s": DEFAULT_COSTS.stock_upload_bytes_per_s}
for name in ("calibrate-16.json", "calibrate-8.json"):
    try:
        doc = json.loads((out / name).read_text())
    except (OSError, ValueError) as exc:
        print(f"{name}: {exc}")
        continue
    for k in keys:
        v = doc.get(k)
        print(f"{name} {k}: {v} against the default {defaults[k]:g}" + (f" ({v / defaults[k]:.2f}x)" if v else ""))
    print(f"{name} notes: {doc.get('notes')}")
PY
for n in 16 8; do
    moeplug plan $MODEL --vram-budget 12GiB --calibration $OUT/calibrate-$n.json --json > $OUT/plan-$n.json 2>&1
done
moeplug plan $MODEL --vram-budget 12GiB --json > $OUT/plan-default.json 2>&1
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for name in ("plan-default.json", "plan-16.json", "plan-8.json"):
    try:
        p = json.loads((Path(sys.argv[1]) / name).read_text())
    except (OSError, ValueError) as exc:
        print(f"{name}: {exc}")
        continue
    print(name, "whole", p["whole_layers"], "slots", p["slots_total"], "stream", p["stream_share"], "policy",
          p["cache_policy"], "threads", p["threads"], "host ms", round(p["modelled_host_ms"] or 0, 2))
PY
echo "total $SECONDS s"
