"""What prompt batches cost per layer, from a profile alone (no GPU): the planner's prompt model.

    python native/bench/prompt_cost.py MODEL PROFILE [--budget 8GiB] [--weights 0,1,4] [--stock-whole 19]

Prints, per MoE layer, the distinct experts one prompt batch picks (the profile's prompt tokens,
per prompt, in batches of llama-server's ubatch), then for a placement of whole layers first and
the rest in RAM (what stock --fit keeps at the budget: `--stock-whole N` whole layers) and for
the planner's plan at each prefill weight: the layers that are not whole, the experts a 64-token
prompt uploads, and the modelled time per prompt token and per generated token (plugin/planner/allocate.py:
the uploads at the rate fitted to the cache's path, or to stock's for the stock row; the decode
model as calibrated). Run `2026-12-01-record-cost-speculation`'s diagnosis of the Qwen3-30B-A3B shape's prefill used it
(native/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from moeplug.core.errors import MoeplugError
    from moeplug.model.inspect import inspect_model
    from moeplug.planner.estimates import DEFAULT_UBATCH
    from moeplug.planner.plan import make_plan
    from moeplug.planner.request import MachineFacts, PlanRequest
    from moeplug.planner.stages import layer_costs
    from moeplug.profile.format import read_profile
    from moeplug.core.sizes import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--budget", default="8GiB", help="the VRAM budget of the plans (moeplug's own estimate of the rest)")
    ap.add_argument("--weights", default="0,1,4", help="prefill weights (prompt tokens per generated token) to plan at")
    ap.add_argument("--stock-whole", type=int, default=None,
                    help="whole layers of the stock placement (default: as many as the planner's expert room holds)")
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args(argv)
    try:
        info = inspect_model(a.model)
        profile = read_profile(a.profile)
        budget = parse_size(a.budget)
        weights = [float(w) for w in a.weights.split(",") if w.strip()]
    except (MoeplugError, ValueError, OSError) as exc:
        print(f"prompt_cost: {exc}", file=sys.stderr)
        return 2
    costs = layer_costs(info, profile, PlanRequest(a.ctx, ubatch=DEFAULT_UBATCH), MachineFacts(), copy_ahead=True)
    if costs[0].prefill is None:
        print("prompt_cost: the profile holds no prompt tokens", file=sys.stderr)
        return 2
    per_token = np.stack([c.prefill for c in costs])  # experts uploaded per prompt token, by slots
    tokens_per_batch = 1 / costs[0].prefill_batches
    distinct = per_token[:, 0] * tokens_per_batch
    print(f"# {info.arch}, {len(info.layers)} MoE layers x {info.n_expert} experts; profile {a.profile.name}: "
          f"{tokens_per_batch:.0f} prompt tokens per batch on average")
    print("distinct experts per prompt batch, by layer: " + " ".join(f"{d:.0f}" for d in distinct))

    def modelled(slots: list[int], stock: bool) -> tuple[int, float, float, float]:
        not_whole = [i for i, n in enumerate(slots) if n < info.n_expert]
        up = sum(per_token[i][slots[i]] for i in not_whole) * 64
        prompt = sum(float(costs[i].prompt_seconds(np.array(slots[i]), stock)) for i in not_whole)
        decode = sum(float(costs[i].seconds(np.array(slots[i]), stock)) for i in not_whole) - prompt
        return len(not_whole), up, prompt, decode

    plans = {f"planner, prefill weight {w:g}":
             make_plan(info, PlanRequest(a.ctx, budget, prefill_weight=w), profile_path=a.profile).slots_per_layer
             for w in weights}
    room_slots = sum(next(iter(plans.values())))
    whole = a.stock_whole if a.stock_whole is not None else room_slots // info.n_expert
    rows = {f"{whole} whole layers first, the rest in RAM (stock --fit's rule)":
            [info.n_expert] * whole + [0] * (len(info.layers) - whole), **plans}
    print("\n| placement | layers not whole | experts uploaded per 64 prompt tokens | prompt us/token | decode us/token |")
    print("|---|---:|---:|---:|---:|")
    for name, slots in rows.items():
        n, up, prompt, decode = modelled(slots, "stock" in name)
        print(f"| {name} | {n} | {up:.0f} | {prompt * 1e6:.0f} | {decode * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
