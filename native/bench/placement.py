"""Where the layers whose experts stay in RAM sit, and what prefill pays for it: the experiment
behind the planner's rule (whole layers first, partly resident ones after them; plugin/planner/allocate.py).

Run on a machine with an NVIDIA GPU, after bench.py has built and written its model and profile
(`bench.py --build-only`, or any earlier run):

    python native/bench/placement.py [--rounds 3] [--prebuilt BIN]

At an emulated 16 GiB card, prefill only (pp512, --pp-reps repetitions a run, the first dropped),
rows with the same expert bytes on the GPU in other places, interleaved in rounds as bench.py does:
stock --fit and its own placement by -ot (45 whole layers, layer 45's `up` on the GPU); three
layers in RAM mid-model (4, 30, 47) or at the end (45, 46, 47), without slots and with the 42 slots
those bytes buy, each with the default max batch and with every batch through the slots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import (
    GIB,
    MIB,
    Row,
    free_vram_or_say,
    patched_build,
    print_table,
    run_rounds,
)

BUDGET_GIB = 16
EXPERTS = r"\.ffn_(up|down|gate)_exps=CPU"


def in_ram(blocks: list[int]) -> list[str]:
    return ["-ngl", "99", "-ot", rf"blk\.({'|'.join(map(str, blocks))}){EXPERTS}"]


def slots(per_layer: dict[int, int], n_layer: int, profile: Path) -> list[str]:
    counts = ",".join(str(per_layer.get(i, 0)) for i in range(n_layer))
    return ["--moe-cache-slots", counts, "--moe-cache-profile", str(profile)]


def placement_rows(margin_mib: int, n_layer: int, profile: Path) -> list[Row]:
    label, every_batch = f"{BUDGET_GIB} GiB", ["--moe-cache-max-batch", "512"]
    fit_by_ot = ["-ngl", "99", "-ot", r"blk\.45\.ffn_(gate|down)_exps=CPU;blk\.(46|47)" + EXPERTS]
    rows = [Row(label, "stock --fit", ["-fitt", str(margin_mib)], True),
            Row(label, "fit's placement by -ot", fit_by_ot, False),
            Row(label, "4, 30, 47 in RAM, no slots", in_ram([4, 30, 47]), False),
            Row(label, "45, 46, 47 in RAM, no slots", in_ram([45, 46, 47]), False)]
    for blocks, slot_layers in (([4, 30, 47], {4: 26, 30: 16}), ([45, 46, 47], {45: 26, 46: 16}),
                                ([45, 46, 47], {45: 42})):
        desc = f"{', '.join(map(str, blocks))} in RAM, slots {' '.join(f'{b}:{n}' for b, n in slot_layers.items())}"
        cache = in_ram(blocks) + slots(slot_layers, n_layer, profile)
        rows.append(Row(label, desc, cache, False))
        rows.append(Row(label, f"{desc}, every batch", cache + every_batch, False))
    return rows


def main() -> int:
    from moeplug.model.inspect import inspect_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp-reps", type=int, default=10)
    ap.add_argument("--model", type=Path, default=Path("/tmp/moeplug-bench/qwen3-30b-a3b-shape-q4_k.gguf"))
    ap.add_argument("--prebuilt", type=Path, help="a bin/ folder of a patched CUDA build")
    ap.add_argument("--jobs", type=int, default=0)
    a = ap.parse_args()
    if a.rounds < 1 or a.pp_reps < 1:
        ap.error("--rounds and --pp-reps must be at least 1")
    profile = a.model.with_suffix(".random.profile.gguf")
    if not (a.model.exists() and profile.exists()):
        print(f"{a.model} or its profile is missing: run bench.py --build-only first", file=sys.stderr)
        return 1
    free = free_vram_or_say("this experiment")
    if free is None:
        return 1
    patched = patched_build(a.prebuilt, a.jobs)
    info = inspect_model(a.model)
    if info.n_layer != 48 or info.n_expert != 128:
        print(f"{a.model}: not the 48-layer, 128-expert benchmark model the rows are laid out for", file=sys.stderr)
        return 1
    rows = placement_rows(max(0, (free - BUDGET_GIB * GIB) // MIB), info.n_layer, profile)
    run_rounds(rows, lambda row: patched.binary("llama-bench"), a.model, ["pinned"], a.rounds, 512, 0, 1, a.pp_reps)
    print_table(rows, 512, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
