"""Two GPUs: which layers each GPU holds, and each GPU's whole layers and slots within its budget.

llama.cpp's layer split (`-sm layer --tensor-split A,B`, arithmetic in split.py) gives each GPU a
contiguous run of blocks, the second GPU the last ones and the output layer; a layer's non-expert
weights and KV cache live on its GPU, and so do its whole-layer experts and its slots (the native
cache uploads a layer's slots to that layer's device). So a split point k (blocks [0, k) on GPU 0,
the rest and the output layer on GPU 1) fixes what each GPU holds besides experts:

    GPU d: its blocks' non-expert weights + their KV cache + a compute buffer and CUDA pool
           headroom + the safety margin (each GPU has its own) [+ on the output layer's GPU
           every tensor outside the blocks: the output layer, and the token embeddings, which
           llama.cpp keeps in RAM: counted on the high side, as the one-GPU plan counts them]

and its budget less that is its room for experts. The allocator (allocate.py) then runs per GPU
over the MoE layers that GPU holds, with that GPU's room (without a profile: whole layers from
the first of that GPU's layers, stock's placement), so each GPU's whole layers come first and its
partly resident layers follow them, and no GPU's experts exceed its room.

The split point is searched, not derived: every k from 0 to n_layer + 1 is tried, and the plan
takes the k with the least
modelled CPU time per token (allocate.modelled_seconds) over the k whose fixed bytes fit both
budgets; between equal times the one whose smaller headroom is the largest (the most even
margin), then the lowest k. The flags carry the integer proportions `k,(n_layer + 1 - k)`, which
llama.cpp's float arithmetic turns into exactly that split (split.split_for checks it). The
split is planned for -ngl covering every layer (moeplug passes -ngl 99). The search costs what
n_layer + 2 one-GPU allocations cost: a two-GPU plan of a 48-layer, 128-expert model with a
profile took 3.9 s (25% of the expert bytes) and 7.7 s (50%) on a 2-core machine under a load of
10, where the one-GPU plan took 0.2 s.

Not measured on a two-GPU machine yet; the estimate of each GPU's other buffers is moeplug's own
(estimates.py), not llama-fit-params' (which the one-GPU plan uses where it sees a GPU).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from moeplug.allocate import LayerCost, allocate, modelled_seconds
from moeplug.errors import MoeplugError
from moeplug.estimates import (
    CUDA_POOL_HEADROOM,
    SAFETY_MARGIN,
    compute_buffer_bytes,
    kv_cache_bytes_per_block,
    whole_layers_first,
)
from moeplug.model_inspect import ModelInfo
from moeplug.sizes import GIB
from moeplug.split import split_for

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass
class DevicePlan:
    device: str  # CUDA0, CUDA1: CUDA device order
    budget_bytes: int
    blocks: list[int]  # the repeating layers (blocks) on this GPU, in order
    output: bool  # the output layer is here (with every tensor outside the blocks)
    moe_layers: int
    whole_layers: int
    slots: int  # slots of this GPU's partly resident layers
    non_expert_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    margin_bytes: int
    expert_vram_bytes: int  # whole layers and slots

    @property
    def used_bytes(self) -> int:
        return (self.non_expert_bytes + self.kv_cache_bytes + self.compute_bytes + self.margin_bytes
                + self.expert_vram_bytes)

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"used_bytes": self.used_bytes, "headroom_bytes": self.headroom_bytes}


@dataclass
class SplitPlan:
    tensor_split: list[int]  # --tensor-split proportions
    slots_per_layer: list[int]  # per MoE layer, in block order
    devices: list[DevicePlan]
    room: int  # expert room of every GPU together


def non_expert_bytes_by_block(info: ModelInfo) -> tuple[list[int], int]:
    """Bytes of each block's tensors other than its routed experts, and of the tensors outside the
    blocks (output layer, norms, token embeddings)."""
    experts = {f"blk.{layer.block}.{key}" for layer in info.layers for key in layer.tensors}
    per_block, outside = [0] * info.n_layer, 0
    for t in info.tensors:
        if t.name in experts:
            continue
        m = _BLOCK_RE.match(t.name)
        if m and int(m[1]) < info.n_layer:
            per_block[int(m[1])] += t.n_bytes
        else:
            outside += t.n_bytes
    return per_block, outside


def _device_slots(info: ModelInfo, costs: list[LayerCost], idx: list[int], room: int, profiled: bool) -> list[int]:
    if not idx:
        return []
    if profiled:
        return allocate([costs[i] for i in idx], room)
    return whole_layers_first(info, room, [info.layers[i] for i in idx])


def plan_split(info: ModelInfo, ctx: int, budgets: list[int], costs: list[LayerCost], profiled: bool) -> SplitPlan:
    """The split point and per-GPU slots for two budgets (module docstring)."""
    if len(budgets) != 2:
        raise MoeplugError(f"moeplug plans one or two GPUs, not {len(budgets)}")
    n = info.n_layer
    if n + 1 > 99:  # the split is planned for -ngl covering every layer, and the flags say -ngl 99
        raise MoeplugError(f"{info.path}: {n} blocks: two-GPU plans cover models of at most 98 blocks")
    per_block, outside = non_expert_bytes_by_block(info)
    kv = kv_cache_bytes_per_block(info, ctx)
    compute = compute_buffer_bytes(info) + CUDA_POOL_HEADROOM
    best: tuple[float, float, int] | None = None
    chosen: SplitPlan | None = None
    least_over = None
    for k in range(n + 2):
        block_sets = [list(range(0, min(k, n))), list(range(min(k, n), n))]
        output = [k > n, k <= n]
        devices, rooms = [], []
        for d, blocks in enumerate(block_sets):
            fixed_ne = sum(per_block[b] for b in blocks) + (outside if output[d] else 0)
            fixed_kv = sum(kv[b] for b in blocks)
            rooms.append(budgets[d] - fixed_ne - fixed_kv - compute - SAFETY_MARGIN)
            devices.append(DevicePlan(f"CUDA{d}", budgets[d], blocks, output[d], 0, 0, 0, fixed_ne, fixed_kv,
                                      compute, SAFETY_MARGIN, 0))
        if min(rooms) < 0:
            over = -min(rooms)
            least_over = over if least_over is None else min(least_over, over)
            continue
        slots = [0] * len(info.layers)
        seconds = 0.0
        for d, dev in enumerate(devices):
            held = set(dev.blocks)
            idx = [i for i, layer in enumerate(info.layers) if layer.block in held]
            got = _device_slots(info, costs, idx, rooms[d], profiled)
            for i, s in zip(idx, got):
                slots[i] = s
            seconds += modelled_seconds([costs[i] for i in idx], got)
            dev.moe_layers = len(idx)
            dev.whole_layers = sum(s >= info.n_expert for s in got)
            dev.slots = sum(s for s in got if s < info.n_expert)
            dev.expert_vram_bytes = sum(s * info.layers[i].bytes_per_expert for i, s in zip(idx, got))
        key = (round(seconds, 12), -min(dev.headroom_bytes for dev in devices), k)  # equal: to the picosecond
        if best is None or key < best:
            best = key
            chosen = SplitPlan(split_for(n, k), slots, devices, sum(rooms))
    if chosen is None:
        raise MoeplugError(f"the budgets of {budgets[0] / GIB:.2f} and {budgets[1] / GIB:.2f} GiB do not hold the "
                           f"model's other weights, KV cache and buffers however the layers are split (one GPU "
                           f"lacks at least {(least_over or 0) / GIB:.2f} GiB): lower --ctx or use a smaller quant")
    return chosen
