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
from moeplug.planner.split import layer_devices, split_counts
from moeplug.planner.costs import CostModel

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class SplitDevice:
    """A device the layers are split over, in llama.cpp's order (remote devices first)."""

    name: str  # CUDA0, CUDA1: CUDA device order; RPC0, RPC1: llama.cpp's names of remote devices
    budget: int
    endpoint: str | None = None  # a remote device's rpc-server (HOST:PORT); None: a GPU of this machine
    free: int | None = None  # a remote device's free memory when planned (stock's -fitt there)


@dataclass
class DevicePlan:
    device: str  # CUDA0, CUDA1: CUDA device order; RPC0, ...: remote devices (machine.rpc)
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
    endpoint: str | None = None  # a remote device's rpc-server; None: a GPU of this machine
    free_bytes: int | None = None  # a remote device's free memory when planned

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
        doc = asdict(self) | {"used_bytes": self.used_bytes, "headroom_bytes": self.headroom_bytes}
        return doc if self.endpoint else {k: v for k, v in doc.items() if k not in ("endpoint", "free_bytes")}

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

    def __init__(self, info: ModelInfo, ctx: int, spec: Speculation | None, machine: CostModel):
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
        self.compute = draft_compute_bytes(self.model, machine) if self.kind else 0

    def share(self, proportions: list[int]) -> DraftShare:
        m = len(proportions)
        if self.kind is None:
            return DraftShare([0] * m, [0] * m, [0] * m)
        n = self.model.n_layer
        where = layer_devices(n, proportions, 99)  # -ngld 99 (the target's blocks: -ngl 99)
        weights, kv, held = [0] * m, [0] * m, [False] * m
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


class _Split:
    """What every split point is weighed with: each block's bytes and the model's costs (plan_split)."""

    def __init__(self, info: ModelInfo, trunk: ModelInfo, ctx: int, devices: list[SplitDevice],
                 costs: list[LayerCost], profiled: bool, spec: Speculation | None, machine: CostModel, hop_s: float):
        self.info, self.trunk, self.devices, self.costs, self.profiled, self.hop_s = (info, trunk, devices, costs,
                                                                                      profiled, hop_s)
        self.draft = DraftSplit(info, ctx, spec, machine)
        self.margin = machine.safety_margin
        self.per_block, self.outside = bytes_by_block(info)
        if self.draft.kind == "mtp":  # the NextN blocks' weights are the draft's (all of them, experts included)
            self.per_block = [0 if self.draft.per_block[b] else self.per_block[b] for b in range(info.n_layer)]
        self.kv = kv_cache_bytes_per_block(info, ctx)
        self.compute = compute_buffer_bytes(info) + machine.cuda_pool_headroom
        with_experts, _ = bytes_by_block(info, experts=True)
        self.whole_block = [with_experts[b] + self.kv[b] for b in range(info.n_layer)]

    def whole_blocks(self, budget: int, start: int) -> int:
        """How many blocks from `start` a device holds whole (experts and KV cache) within `budget`."""
        room, b = budget - self.compute - self.margin, start
        while b < self.info.n_layer and self.whole_block[b] <= room:
            room -= self.whole_block[b]
            b += 1
        return b - start

    def weigh(self, block_sets: list[list[int]], output: list[bool]) -> tuple[tuple, SplitPlan] | int:
        """The slots of one split (each device's blocks, and which holds the output layer), its key
        (modelled time, the smallest headroom, the split point), or the bytes the fullest device lacks."""
        counts = [len(blocks) + int(out) for blocks, out in zip(block_sets, output)]
        proportions = split_counts(self.info.n_layer, counts)
        share = self.draft.share(proportions)
        devices = [DevicePlan(d.name, d.budget, blocks, output[i], 0, 0, 0,
                              sum(self.per_block[b] for b in blocks) + (self.outside if output[i] else 0),
                              sum(self.kv[b] for b in blocks), self.compute, self.margin, 0,
                              share.weights[i], share.kv_cache[i], share.compute[i], d.endpoint, d.free)
                   for i, (d, blocks) in enumerate(zip(self.devices, block_sets))]
        rooms = [dev.headroom_bytes for dev in devices]
        if min(rooms) < 0:
            return -min(rooms)
        self.copies_ahead(devices, rooms)
        slots, seconds = [0] * len(self.trunk.layers), 0.0
        for d, dev in enumerate(devices):
            seconds += self.place(dev, rooms[d], slots)
        key = (round(seconds, 12), -min(dev.headroom_bytes for dev in devices), counts[0])  # equal: to the picosecond
        return key, SplitPlan(proportions, slots, devices, sum(rooms))

    def copies_ahead(self, devices: list[DevicePlan], rooms: list[int]) -> None:
        """Prompt batches go to the first GPU of this machine, whose cache copies their experts ahead
        there (plan.py): a second weight copy in its compute buffer where its layers keep experts in RAM."""
        first = next((i for i, dev in enumerate(devices) if dev.endpoint is None), None)
        if first is None or not self.profiled:
            return
        held = set(devices[first].blocks)
        layers = [layer for layer in self.trunk.layers if layer.block in held]
        if rooms[first] < sum(layer.expert_bytes for layer in layers):
            ahead = min(expert_copy_ahead_bytes(self.trunk, layers), rooms[first])
            devices[first].compute_bytes += ahead
            rooms[first] -= ahead

    def place(self, dev: DevicePlan, room: int, slots: list[int]) -> float:
        """The device's whole layers and slots within its room (into `slots`), and their modelled time:
        a remote device's layers cost a hop there and back per step, and each of its layers not whole
        one more, its misses computed on this machine's CPU."""
        held = set(dev.blocks)
        idx = [i for i, layer in enumerate(self.trunk.layers) if layer.block in held]
        got = _device_slots(self.trunk, self.costs, idx, room, self.profiled)
        for i, n in zip(idx, got):
            slots[i] = n
        dev.moe_layers = len(idx)
        dev.whole_layers = sum(n >= self.info.n_expert for n in got)
        dev.slots = sum(n for n in got if n < self.info.n_expert)
        dev.expert_vram_bytes = sum(n * self.trunk.layers[i].bytes_per_expert for i, n in zip(idx, got))
        seconds = modelled_seconds([self.costs[i] for i in idx], got)
        if dev.endpoint is not None and dev.blocks:
            seconds += 2 * self.hop_s * (1 + dev.moe_layers - dev.whole_layers)
        return seconds


def plan_split(info: ModelInfo, trunk: ModelInfo, ctx: int, devices: list[SplitDevice], costs: list[LayerCost],
               profiled: bool, spec: Speculation | None, machine: CostModel, hop_s: float = 0.0) -> SplitPlan:
    """The split and per-device slots (module docstring). info: the whole model (its blocks are what
    llama.cpp splits); trunk: its MoE layers that take slots (costs are theirs); devices: in llama.cpp's
    order, remote ones first: all but the last two take whole blocks from the first block on, as many
    as their budget holds, and the split point between the last two is searched; spec: speculative
    decoding, whose draft each device holds its share of; machine: the machine's figures (its pool headroom
    and safety margin); hop_s: a remote device's round trip."""
    n = info.n_layer
    if n + 1 > 99:  # the split is planned for -ngl covering every layer, and the flags say -ngl 99
        raise MoeplugError(f"{info.path}: {n} blocks: split plans cover models of at most 98 blocks")
    split = _Split(info, trunk, ctx, devices, costs, profiled, spec, machine, hop_s)
    prefix: list[list[int]] = []
    start = 0
    for d in devices[:-2]:
        taken = split.whole_blocks(d.budget, start)
        prefix.append(list(range(start, start + taken)))
        start += taken
    best: tuple | None = None
    chosen: SplitPlan | None = None
    least_over = None
    points = range(start, n + 2) if len(devices) > 1 else [n + 1]
    for k in points:
        tail = [list(range(start, min(k, n))), list(range(min(k, n), n))][:len(devices) - len(prefix)]
        output = [False] * len(prefix) + ([k > n, k <= n] if len(tail) == 2 else [True])
        found = split.weigh(prefix + tail, output)
        if isinstance(found, int):
            least_over = found if least_over is None else min(least_over, found)
            continue
        if best is None or found[0] < best:
            best, chosen = found
    if chosen is None:
        raise MoeplugError(no_split(devices, least_over or 0, split.draft.kind))
    return chosen


def no_split(devices: list[SplitDevice], over: int, draft: str | None) -> str:
    """The one line for budgets that hold the model's other weights however its layers are split."""
    budgets = " and ".join(f"{d.budget / GIB:.2f}" for d in devices)
    also = " and the draft's share" if draft else ""
    return (f"the budgets of {budgets} GiB do not hold the model's other weights, KV cache and buffers{also} however "
            f"the layers are split (one device lacks at least {over / GIB:.2f} GiB): lower --ctx or use a smaller "
            f"quant" + (" or plan without --spec" if draft else ""))
