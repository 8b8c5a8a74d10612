"""Fixtures of the dashboard's tests: a recorded snapshot for the layout, a served demo for the rest."""

from __future__ import annotations

import pytest

from moeplug.planner.record import Plan
from moeplug.machine.gpu import GpuInfo
from moeplug.serving.installed import InstalledModel
from moeplug.serving.metrics import CacheCounters
from moeplug.serving.monitor import LayerSlots, ProfileSummary, ServerMetrics, ServerSnapshot, Snapshot
from moeplug.serving.launch import ServerRecord

GIB = 1 << 30
TAKEN_AT = 1_780_000_000.0  # a fixed clock: ages and uptimes render the same on every run


def _recorded() -> Snapshot:
    """A 12-layer x 64-expert model on one 24 GiB GPU at a 12 GiB budget, served with --metrics,
    an hour after launch; and an installed model that is not served. Numbers of a plausible
    run, fixed, so the screenshot only changes when the dashboard does."""
    slots = [64, 64, 64, 40, 36, 32, 32, 28, 24, 24, 20, 16]
    predicted = [1.0, 1.0, 1.0, 0.86, 0.81, 0.77, 0.76, 0.71, 0.66, 0.65, 0.58, 0.49]
    measured = [None, None, None, 0.84, 0.80, 0.79, 0.74, 0.70, 0.67, 0.62, 0.57, 0.51]
    layers, counted = [], {}
    for block, (n, p, m) in enumerate(zip(slots, predicted, measured)):
        sel = None if m is None else 81_920
        hits = None if m is None else round(m * 81_920)
        layers.append(LayerSlots(block, n, 64, p, sel, hits))
        if sel is not None:
            counted[block] = {"selections": sel, "hits": hits}
    counters = CacheCounters(selections=9 * 81_920, hits=sum(v["hits"] for v in counted.values()),
                             cpu_experts=9 * 81_920 - sum(v["hits"] for v in counted.values()),
                             cpu_bytes=412 * (1 << 20) * 40, layers=counted)
    plan = Plan.from_json({"fit_fraction": 0.63, "predicted_hit_rate": 0.75, "vram_budget_bytes": 12 * GIB,
            "server_args": ["-c", "8192", "-ngl", "99", "-fit", "off", "-lm", "none", "-ot",
                            r"blk\.(3|4|5|6|7|8|9|10|11)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU",
                            "--moe-cache-slots", "0,0,0,40,36,32,32,28,24,24,20,16", "--moe-cache-profile",
                            "/home/me/.local/share/moeplug/profiles/qwen3moe-1f2e3d4c.gguf",
                            "--moe-cache-max-batch", "512"],
            "notes": ["3 whole layers resident (no CPU pass)"], "warnings": [], "slots_per_layer": slots,
            "n_expert": 64})
    record = ServerRecord(name="qwen3-moe-a2b", model="/models/qwen3-moe-a2b-Q4_K_M.gguf", pid=41873, port=41237,
                          log="/home/me/.local/state/moeplug/logs/server-qwen3-moe-a2b.log",
                          args=["llama-server", "--metrics", *plan.server_args], started=TAKEN_AT - 3725,
                          build_id="b11434-cuda-moeplug-cafab2c54cab",
                          cache={"engaged": True, "layers": 9, "slots": 40, "slots_min": 16, "slots_total": 252,
                                 "whole_layers": 0, "mib_uploaded": 2034.5, "device": "CUDA0", "seconds": 0.61,
                                 "reason": ""})
    served = ServerSnapshot(record=record, alive=True, healthy=True, uptime_s=3725.0, cache_counters=counters,
                            metrics=ServerMetrics(52_310, 41.2, 40_960, 1_024.0, 1, 0), ctx_used=2_876, n_ctx=8192,
                            plan=plan, layers=layers,
                            profile=ProfileSummary("/home/me/.local/share/moeplug/profiles/qwen3moe-1f2e3d4c.gguf",
                                                   TAKEN_AT - 2 * 86400, ["codeish", "chatty"], 3_655, 16_384,
                                                   {8: 0.31, 16: 0.52, 32: 0.79, 64: 1.0}))
    other = InstalledModel(name="demo", ref="demo", path="/home/me/.local/share/moeplug/models/demo.gguf",
                           profile=None, build_id=record.build_id, ctx=4096, plan=plan, installed_at=TAKEN_AT)
    gpu = GpuInfo(0, "NVIDIA GeForce RTX 4090", 24 * GIB, int(11.4 * GIB), int(12.6 * GIB), 37, "89")
    return Snapshot(taken_at=TAKEN_AT, servers=[served], gpus=[gpu], installed=[other])


@pytest.fixture
def recorded() -> Snapshot:
    return _recorded()
