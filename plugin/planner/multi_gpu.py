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

Speculative decoding (speculation.py) with two GPUs: llama.cpp gives the draft the target's own
split (common_base_params_to_speculative copies the target's parameters, `-sm layer` and
`--tensor-split` included, and moeplug passes no `-devd`), so a draft model's blocks go to the GPUs
by the same proportions over its own n_layer + 1 layers (split.layer_devices; `-ngld 99`), its
output layer and other tensors outside the blocks with its last layer. Each GPU's share of the
draft's weights (experts included) and of its KV cache at the served context comes off that
GPU's budget, and a draft compute buffer (speculation.draft_compute_bytes) off every GPU that
holds part of the draft. An MTP head's NextN blocks are the model's last blocks: they stay where
the target's split puts them (the second GPU unless it holds no block), whole (experts included)
with their KV cache, and the draft compute buffer goes to the GPUs that hold them. The search
over split points counts the draft for each k, so the chosen split is one where both fit.
N-gram drafts hold nothing on a GPU.

Not measured on a two-GPU machine yet; the estimate of each GPU's other buffers is moeplug's own
(estimates.py), not llama-fit-params' (which the one-GPU plan uses where it sees a GPU).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from moeplug.planner.allocate import LayerCost, allocate, modelled_seconds
from moeplug.core.errors import MoeplugError
from moeplug.planner.estimates import (compute_buffer_bytes, expert_copy_ahead_bytes, kv_cache_bytes_per_block, whole_layers_first)
from moeplug.model.inspect import ModelInfo
from moeplug.core.sizes import GIB
from moeplug.planner.speculation import Speculation, draft_compute_bytes, nextn_blocks, read_draft
from moeplug.planner.split import layer_devices, split_for
from moeplug.planner.costs import DEFAULT_COSTS

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
    # speculative decoding: this GPU's share of the draft (module docstring)
    draft_weights_bytes: int = 0
    draft_kv_cache_bytes: int = 0
    draft_compute_bytes: int = 0

    @property
    def draft_bytes(self) -> int:
        return self.draft_weights_bytes + self.draft_kv_cache_bytes + self.draft_compute_bytes

    @property
    def used_bytes(self) -> int:
        return (self.non_expert_bytes + self.kv_cache_bytes + self.compute_bytes + self.margin_bytes
                + self.expert_vram_bytes + self.draft_bytes)

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"used_bytes": self.used_bytes, "headroom_bytes": self.headroom_bytes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DevicePlan:
        """As to_json wrote it (the derived figures left out)."""
        return cls(**{f.name: doc[f.name] for f in fields(cls) if f.name in doc})


@dataclass
class SplitPlan:
    tensor_split: list[int]  # --tensor-split proportions
    slots_per_layer: list[int]  # per MoE layer of the trunk (plan.trunk_of), in block order
    devices: list[DevicePlan]
    room: int  # expert room of every GPU together


def bytes_by_block(info: ModelInfo, experts: bool = False) -> tuple[list[int], int]:
    """Bytes of each block's tensors (without its routed experts unless experts), and of the
    tensors outside the blocks (output layer, norms, token embeddings)."""
    skip = set() if experts else {f"blk.{layer.block}.{key}" for layer in info.layers for key in layer.tensors}
    per_block, outside = [0] * info.n_layer, 0
    for t in info.tensors:
        if t.name in skip:
            continue
        m = _BLOCK_RE.match(t.name)
        if m and int(m[1]) < info.n_layer:
            per_block[int(m[1])] += t.n_bytes
        else:
            outside += t.n_bytes
    return per_block, outside


@dataclass(frozen=True)
class DraftShare:
    """What the draft puts on each GPU for one split point: weights, KV cache, compute (bytes)."""

    weights: list[int]
    kv_cache: list[int]
    compute: list[int]


class DraftSplit:
    """The draft's bytes per GPU as a function of the target's split (module docstring)."""

    def __init__(self, info: ModelInfo, ctx: int, spec: Speculation | None):
        self.kind = spec.kind if spec is not None and spec.kind != "ngram" else None
        self.model = read_draft(spec) if self.kind == "draft" else info
        if self.kind == "draft":
            self.per_block, self.outside = bytes_by_block(self.model, experts=True)
            self.kv = kv_cache_bytes_per_block(self.model, ctx)
        elif self.kind == "mtp":
            per_block, _ = bytes_by_block(info, experts=True)
            self.per_block = [n if b in nextn_blocks(info) else 0 for b, n in enumerate(per_block)]
            self.outside = 0
            self.kv = kv_cache_bytes_per_block(info, ctx, mtp=True)
        self.compute = draft_compute_bytes(self.model) if self.kind else 0

    def share(self, proportions: list[int]) -> DraftShare:
        if self.kind is None:
            return DraftShare([0, 0], [0, 0], [0, 0])
        n = self.model.n_layer
        where = layer_devices(n, proportions, 99)  # -ngld 99 (the target's blocks: -ngl 99)
        weights, kv, held = [0, 0], [0, 0], [False, False]
        for b in range(n):
            if where[b] is not None and (self.per_block[b] or self.kv[b]):
                weights[where[b]] += self.per_block[b]
                kv[where[b]] += self.kv[b]
                held[where[b]] = True
        if self.outside and where[n] is not None:
            weights[where[n]] += self.outside
            held[where[n]] = True
        return DraftShare(weights, kv, [self.compute if h else 0 for h in held])


def _device_slots(info: ModelInfo, costs: list[LayerCost], idx: list[int], room: int, profiled: bool) -> list[int]:
    if not idx:
        return []
    if profiled:
        return allocate([costs[i] for i in idx], room)
    return whole_layers_first(info, room, [info.layers[i] for i in idx])


def plan_split(info: ModelInfo, trunk: ModelInfo, ctx: int, budgets: list[int], costs: list[LayerCost],
               profiled: bool, spec: Speculation | None = None) -> SplitPlan:
    """The split point and per-GPU slots for two budgets (module docstring). info: the whole model
    (its blocks are what llama.cpp splits); trunk: its MoE layers that take slots (costs are
    theirs); spec: speculative decoding, whose draft each GPU holds its share of."""
    if len(budgets) != 2:
        raise MoeplugError(f"moeplug plans one or two GPUs, not {len(budgets)}")
    n = info.n_layer
    if n + 1 > 99:  # the split is planned for -ngl covering every layer, and the flags say -ngl 99
        raise MoeplugError(f"{info.path}: {n} blocks: two-GPU plans cover models of at most 98 blocks")
    draft = DraftSplit(info, ctx, spec)
    per_block, outside = bytes_by_block(info)
    if draft.kind == "mtp":  # the NextN blocks' weights are the draft's (all of them, experts included)
        per_block = [0 if draft.per_block[b] else per_block[b] for b in range(n)]
    kv = kv_cache_bytes_per_block(info, ctx)
    compute = compute_buffer_bytes(info) + DEFAULT_COSTS.cuda_pool_headroom
    best: tuple[float, float, int] | None = None
    chosen: SplitPlan | None = None
    least_over = None
    for k in range(n + 2):
        block_sets = [list(range(0, min(k, n))), list(range(min(k, n), n))]
        output = [k > n, k <= n]
        proportions = split_for(n, k)
        share = draft.share(proportions)
        devices, rooms = [], []
        for d, blocks in enumerate(block_sets):
            fixed_ne = sum(per_block[b] for b in blocks) + (outside if output[d] else 0)
            fixed_kv = sum(kv[b] for b in blocks)
            dev = DevicePlan(f"CUDA{d}", budgets[d], blocks, output[d], 0, 0, 0, fixed_ne, fixed_kv, compute,
                             DEFAULT_COSTS.safety_margin, 0, share.weights[d], share.kv_cache[d], share.compute[d])
            rooms.append(dev.headroom_bytes)
            devices.append(dev)
        if min(rooms) < 0:
            over = -min(rooms)
            least_over = over if least_over is None else min(least_over, over)
            continue
        # prompt batches go to the first GPU, whose cache copies their experts ahead there (plan.py): a second
        # weight copy in its compute buffer where its layers keep experts in RAM
        on_first = set(block_sets[0])
        first = [layer for layer in trunk.layers if layer.block in on_first]
        if profiled and rooms[0] < sum(layer.expert_bytes for layer in first):
            ahead = min(expert_copy_ahead_bytes(trunk, first), rooms[0])
            devices[0].compute_bytes += ahead
            rooms[0] -= ahead
        slots = [0] * len(trunk.layers)
        seconds = 0.0
        for d, dev in enumerate(devices):
            held = set(dev.blocks)
            idx = [i for i, layer in enumerate(trunk.layers) if layer.block in held]
            got = _device_slots(trunk, costs, idx, rooms[d], profiled)
            for i, s in zip(idx, got):
                slots[i] = s
            seconds += modelled_seconds([costs[i] for i in idx], got)
            dev.moe_layers = len(idx)
            dev.whole_layers = sum(s >= info.n_expert for s in got)
            dev.slots = sum(s for s in got if s < info.n_expert)
            dev.expert_vram_bytes = sum(s * trunk.layers[i].bytes_per_expert for i, s in zip(idx, got))
        key = (round(seconds, 12), -min(dev.headroom_bytes for dev in devices), k)  # equal: to the picosecond
        if best is None or key < best:
            best = key
            chosen = SplitPlan(proportions, slots, devices, sum(rooms))
    if chosen is None:
        also = " and the draft's share" if draft.kind else ""
        raise MoeplugError(f"the budgets of {budgets[0] / GIB:.2f} and {budgets[1] / GIB:.2f} GiB do not hold the "
                           f"model's other weights, KV cache and buffers{also} however the layers are split (one GPU "
                           f"lacks at least {(least_over or 0) / GIB:.2f} GiB): lower --ctx or use a smaller quant"
                           + (" or plan without --spec" if draft.kind else ""))
    return chosen
