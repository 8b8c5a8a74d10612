"""The slot planner: how many experts of each MoE layer fit in the GPU budget, and the flags to run.

VRAM budget (NVML free memory, or --vram-budget) minus what llama.cpp puts on the GPU anyway
(non-expert weights, the KV cache at the context size, the compute buffer and CUDA pool
headroom, a safety margin) leaves room for slots, which allocate.py spreads over the layers
from the profile's hit curves. The same budget also gives stock llama.cpp's best placement
(`-ncmoe K`), shown beside it.

Two budgets (two GPUs, `--vram-budget 12GiB,12GiB`) plan each GPU's layers, whole layers and
slots within that GPU's budget, and pass the layer split as `-sm layer --tensor-split A,B`
(multi_gpu.py; llama.cpp's split arithmetic in split.py). One budget plans one GPU as before.

The parts live by concern: the estimates in estimates.py, the llama-server flags in
server_flags.py, size parsing in sizes.py, free RAM in probes.py and free VRAM in gpu.py.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from moeplug.allocate import LayerCost, allocate, hit_curves, modelled_seconds
from moeplug.errors import MoeplugError
from moeplug.fit_estimate import CUDA_CONTEXT_RESERVE, DeviceNeed
from moeplug.estimates import (
    CUDA_POOL_HEADROOM,
    SAFETY_MARGIN,
    bytes_per_slot,
    choose_load_mode,
    compute_buffer_bytes,
    kv_cache_bytes,
    stock_ncmoe,
    whole_layers_first,
)
from moeplug.model_inspect import ModelInfo
from moeplug.multi_gpu import plan_split
from moeplug.profile.format import Profile
from moeplug.server_flags import DYNAMIC_ARGS, placement_args
from moeplug.sizes import GIB

WARN_FIT = 0.20
WARN_FIT_STRONG = 0.15


def _layer_costs(info: ModelInfo, profile: Profile | None) -> list[LayerCost]:
    curves = hit_curves(profile, len(info.layers), info.n_expert)
    return [LayerCost(layer.bytes_per_expert, layer.n_expert, info.n_expert_used, curve)
            for layer, curve in zip(info.layers, curves)]


@dataclass
class Plan:
    model: str
    backend: str  # "cuda" or "cpu"
    ctx: int
    vram_budget_bytes: int | None
    non_expert_vram_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    margin_bytes: int
    bytes_per_slot: int
    n_expert: int
    n_moe_layers: int
    slots_per_layer: list[int]  # per MoE layer, in block order
    slots_total: int
    whole_layers: int  # layers with every expert resident: no CPU pass
    expert_vram_bytes: int
    fit_fraction: float
    predicted_hit_rate: float | None
    stock_ncmoe: int | None
    modelled_host_ms: float | None  # CPU-side time per decoded token (allocate.py's model)
    stock_modelled_host_ms: float | None  # the same for stock -ncmoe at this budget
    load_mode: str
    profile: str | None
    server_args: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cache_policy: str = "static"  # "dynamic": the slots follow the prompt (--moe-cache-policy dynamic)
    vram_source: str = "estimate"  # what sized the GPU's other buffers: "estimate" (estimates.py) or "llama-fit-params"
    # two GPUs only (absent from a one-GPU plan's JSON): per GPU what it holds (multi_gpu.DevicePlan's
    # JSON), and the --tensor-split proportions; the figures above are then the sums over the GPUs
    devices: list[dict[str, Any]] | None = None
    tensor_split: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for key in ("devices", "tensor_split"):
            if doc[key] is None:
                del doc[key]
        return doc

    @property
    def budget(self) -> int | list[int] | None:
        """The budget it was planned for, as make_plan takes it: one per GPU where it has two."""
        return [d["budget_bytes"] for d in self.devices] if self.devices else self.vram_budget_bytes

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Plan:
        """A plan as to_json wrote it (an installed record); keys it does not know are dropped,
        required ones it lacks (an older record) are None."""
        known = fields(cls)
        values: dict[str, Any] = {f.name: None for f in known if f.default is MISSING and f.default_factory is MISSING}
        values.update({f.name: doc[f.name] for f in known if f.name in doc})
        return cls(**values)


def _fit_warnings(fit: float, hit: float | None) -> list[str]:
    pct = f"{fit:.0%}"
    expect = f"the profile predicts {hit:.0%} of expert selections served from VRAM" if hit is not None else \
        "no profile to predict the hit rate"
    if fit < WARN_FIT_STRONG:
        return [f"only {pct} of the experts fit in VRAM (below 15%): {expect}; expect decode close to "
                f"--cpu-moe speed, bound by the CPU. A smaller quant or a larger GPU helps more than the cache."]
    if fit < WARN_FIT:
        return [f"only {pct} of the experts fit in VRAM (below 20%): {expect}; most experts run on the CPU."]
    return []


def make_plan(info: ModelInfo, ctx: int, vram_budget: int | list[int] | None, profile_path: Path | None = None,
              ram_available: int | None = None, slots_in_ram: int = 0, expert_room: int | None = None,
              need: DeviceNeed | None = None, policy: str = "auto", profile: Profile | None = None) -> Plan:
    """profile: the profile at profile_path when the caller has read it already (a re-profile's
    preview plans from the profile it is about to store there). slots_in_ram: without a GPU, hold
    that many slots per layer in RAM anyway (the demo's stand-in for a GPU,
    LLAMA_MOE_CACHE_DEVICE=CPU: same results as stock, no speedup).
    expert_room: VRAM for experts when known better than the estimate (measured by llama.cpp's
    own fit, as the benchmark does). need: what llama.cpp's own estimate (fit_estimate.gpu_need)
    says the GPU holds beside the experts; the budget less that and the CUDA context is the
    experts' room. policy: the slot policy, "static", "dynamic" or "auto" (dynamic wherever a
    layer is partly resident: the hot experts move from prompt to prompt, and the swaps cost
    no results). vram_budget: bytes of one GPU, or a list of one per GPU (two: multi_gpu.py; need and
    expert_room apply to one GPU only)."""
    if isinstance(vram_budget, list) and len(vram_budget) == 1:
        vram_budget = vram_budget[0]
    if not info.layers:
        raise MoeplugError(f"{info.path}: no routed-expert tensors: a dense model, nothing for moeplug to plan")
    per_slot = bytes_per_slot(info)
    kv = kv_cache_bytes(info, ctx) if need is None else need.context
    compute = compute_buffer_bytes(info) + CUDA_POOL_HEADROOM if need is None else need.compute
    non_expert = info.non_expert_bytes if need is None else need.model
    margin = SAFETY_MARGIN if need is None else CUDA_CONTEXT_RESERVE
    if profile is None and profile_path:
        profile = _read_profile(profile_path)
    costs = _layer_costs(info, profile)
    load_mode, load_notes = choose_load_mode(info, ram_available)
    n_layers = len(info.layers)
    base = dict(model=str(info.path), ctx=ctx, non_expert_vram_bytes=non_expert, kv_cache_bytes=kv,
                compute_bytes=compute, margin_bytes=margin, bytes_per_slot=per_slot,
                vram_source="estimate" if need is None else "llama-fit-params",
                n_expert=info.n_expert, n_moe_layers=n_layers, load_mode=load_mode,
                profile=str(profile_path) if profile_path else None)
    lm_args = ["-lm", "none"] if load_mode == "pinned" else []

    def summary(slots: list[int], room: int | None = None) -> dict[str, Any]:
        """room: VRAM for experts; fit_fraction is the share of all expert bytes it holds"""
        total = sum(slots)
        all_experts = sum(layer.expert_bytes for layer in info.layers)
        fit = min(room, all_experts) / all_experts if room is not None else total / (info.n_expert * n_layers)
        hit = _predicted_hit(costs, slots) if profile else None
        return dict(slots_per_layer=slots, slots_total=total, whole_layers=sum(n >= info.n_expert for n in slots),
                    fit_fraction=fit, predicted_hit_rate=hit,
                    expert_vram_bytes=sum(n * layer.bytes_per_expert for n, layer in zip(slots, info.layers)))

    if vram_budget is None:
        # pinned memory only speeds up copies to a GPU: without one, mmap
        slots = [min(slots_in_ram, info.n_expert)] * n_layers
        args = ["-c", str(ctx), "-ngl", "0"]
        note = "no NVIDIA GPU found: a CPU plan, every expert on the CPU, no slots"
        if slots[0]:
            args += ["--moe-cache-slots", str(slots[0])]
            args += ["--moe-cache-profile", str(profile_path)] if profile_path else []
            if profile_path and policy in ("auto", "dynamic"):
                base["cache_policy"] = "dynamic"
                args += DYNAMIC_ARGS
            note = (f"no NVIDIA GPU: {slots[0]} slots per layer held in RAM (LLAMA_MOE_CACHE_DEVICE=CPU) to show the "
                    f"cache engage: same results as stock, no speedup")
        return Plan(backend="cpu", vram_budget_bytes=None, stock_ncmoe=None, modelled_host_ms=None,
                    stock_modelled_host_ms=None, server_args=args, notes=[note],
                    **(base | summary(slots) | {"load_mode": "mmap", "expert_vram_bytes": 0}))

    split_args: list[str] = []
    if isinstance(vram_budget, list):
        split = plan_split(info, ctx, vram_budget, costs, profile is not None)
        room, slots = split.room, split.slots_per_layer
        devices = [d.to_json() for d in split.devices]
        base |= {key: sum(d[key] for d in devices) for key in ("kv_cache_bytes", "compute_bytes", "margin_bytes")}
        base |= dict(non_expert_vram_bytes=sum(d["non_expert_bytes"] for d in devices), devices=devices,
                     tensor_split=split.tensor_split, vram_source="estimate")
        split_args = ["-sm", "layer", "--tensor-split", ",".join(map(str, split.tensor_split))]
        vram_budget = sum(vram_budget)
    else:
        room = vram_budget - non_expert - kv - compute - margin if expert_room is None else expert_room
        if room < 0:
            raise MoeplugError(f"the budget of {vram_budget / GIB:.2f} GiB does not hold the model's other weights, "
                               f"KV cache and buffers ({(vram_budget - room) / GIB:.2f} GiB): lower --ctx or use a "
                               f"smaller quant")
        slots = allocate(costs, room) if profile else whole_layers_first(info, room)
    ncmoe = stock_ncmoe(info, room)  # two GPUs: stock's placement for their rooms pooled
    stock_slots = [info.n_expert if layer.block >= ncmoe else 0 for layer in info.layers]
    s = summary(slots, room)
    args = ["-c", str(ctx), "-ngl", "99", *split_args, "-fit", "off", *lm_args]
    notes = list(load_notes)
    whole = s["whole_layers"]
    if whole == n_layers:
        notes.append("every expert fits in VRAM: full offload, no cache needed")
    elif s["slots_total"] == 0:
        args += ["--cpu-moe"]
        notes.append("no room for one slot: every expert on the CPU (--cpu-moe)")
    else:
        partial = any(0 < n < info.n_expert for n in slots)
        base["cache_policy"] = "dynamic" if partial and profile and policy in ("auto", "dynamic") else "static"
        args += placement_args(info, slots, profile, profile_path, base["cache_policy"])
        if base["cache_policy"] == "dynamic":
            notes.append("the slots follow the prompt (--moe-cache-policy dynamic): a hot missed expert replaces "
                         "the coldest resident one between batches, uploaded while the next tokens compute")
        if not profile and split_args:
            notes.append(f"no profile to choose slots: stock placement on each GPU, {whole} whole layer"
                         f"{'s' if whole != 1 else ''} (each GPU's first), the experts of the other "
                         f"{n_layers - whole} in RAM")
        elif not profile:
            notes.append(f"no profile to choose slots: stock placement, {whole} whole layer{'s' if whole != 1 else ''} "
                         f"on the GPU, the experts of the last {n_layers - whole} in RAM")
        elif whole:
            notes.append(f"{whole} whole layer{'s' if whole != 1 else ''} resident (no CPU pass): the profile's "
                         f"hit curves make {'them' if whole != 1 else 'it'} worth more than spreading the slots")
            if "--moe-cache-slots" not in args:
                notes.append("no partly resident layer: stock's placement, nothing for the cache to hold")
    return Plan(backend="cuda", vram_budget_bytes=vram_budget, stock_ncmoe=ncmoe,
                modelled_host_ms=1e3 * modelled_seconds(costs, slots),
                stock_modelled_host_ms=1e3 * modelled_seconds(costs, stock_slots), server_args=args,
                warnings=_fit_warnings(s["fit_fraction"], s["predicted_hit_rate"]), notes=notes, **(base | s))


def describe_slots(slots_per_layer: list[int] | int, n_expert: int) -> str:
    """'8 of 8 per layer', or '0-128 of 128 per layer (31 whole layers)' (an int: older plans)."""
    slots = [slots_per_layer] if isinstance(slots_per_layer, int) else slots_per_layer
    lo, hi = min(slots, default=0), max(slots, default=0)
    span = f"{hi}" if lo == hi else f"{lo}-{hi}"
    whole = sum(n >= n_expert for n in slots)
    plural = "s" if whole != 1 else ""
    return f"{span} of {n_expert} per layer" + (f" ({whole} whole layer{plural})" if whole and lo != hi else "")


def _predicted_hit(costs: list[LayerCost], slots: list[int]) -> float:
    """Share of all selections served by the planned slots, from the hit curves."""
    return float(np.mean([c.hits[min(n, c.n_expert)] for c, n in zip(costs, slots)]))


def _read_profile(path: Path) -> Profile:
    from moeplug.profile.format import read_profile

    return read_profile(path)
