"""One plan at one prompt batch, in the order it is made: setting -> room -> allocation -> flags -> notes.

- setting: the request checked against the model, the trunk's MoE layers (without MTP blocks), the
  draft's needs and each layer's cost curve (allocate.LayerCost, priced by the machine's CostModel);
- room: what the GPU holds beside the experts (the model's other weights, the KV cache, the compute
  buffer, a margin; llama.cpp's own figure where the machine has it), and the room left for experts;
- allocation: whole layers and slots in that room (allocate.py), against stock's placement, with the
  copies ahead and the GPU's share of the misses where they pay; two GPUs through multi_gpu.py;
- flags: llama-server's arguments for the placement (server_flags.py), the cache's policy;
- notes: what the plan says about itself.

plan.make_plan runs this once per candidate prompt batch and copies-ahead choice and keeps the best.
A model's MTP (NextN) blocks are not the trunk's: llama.cpp runs them only for an MTP draft, so the
slots are planned over the trunk's layers; an MTP block's layer gets every slot with `--spec mtp` (a
whole layer on the GPU, counted in the draft's weights) and none otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from moeplug.core.errors import MoeplugError
from moeplug.core.output import human_bytes
from moeplug.core.sizes import GIB
from moeplug.machine.backend import Backend
from moeplug.model.inspect import ModelInfo
from moeplug.planner.allocate import (LayerCost, allocate_against_stock, hit_curves, long_prompt_uploads,
                                      modelled_prompt_seconds, modelled_seconds, prefill_uploads, stream_share)
from moeplug.planner.estimates import (DEFAULT_UBATCH, MIN_UBATCH, bytes_per_slot, cache_compute_extra, cache_compute_single_copy,
                                       choose_load_mode, compute_buffer_bytes, expert_copy_ahead_bytes,
                                       expert_side_bytes, kv_cache_bytes, stock_ncmoe, ubatch_growth_bytes,
                                       whole_layers_first)
from moeplug.planner.costs import DEFAULT_COSTS
from moeplug.planner.multi_gpu import DevicePlan, SplitDevice, plan_split
from moeplug.planner.record import Plan
from moeplug.planner.request import MachineFacts, PlanRequest
from moeplug.planner.server_flags import (COPY_AHEAD_FLAG, OFFLOAD_MIN_BATCH_FLAG, SLOTS_IN_RAM_ARGS, dynamic_args, experts_in_ram_args, placement_args,
                                          ubatch_args)
from moeplug.planner.speculation import SpecNeed, Speculation, nextn_blocks, nextn_weight_bytes, spec_need
from moeplug.profile.format import Profile

WARN_FIT = 0.20
WARN_FIT_STRONG = 0.15


def trunk_of(info: ModelInfo) -> ModelInfo:
    """The model without its MTP (NextN) blocks' MoE layers (the last ones): what the server runs per token."""
    nextn = nextn_blocks(info)
    return replace(info, layers=[layer for layer in info.layers if layer.block not in nextn]) if nextn else info


@dataclass
class Setting:
    """What every stage reads: the model, the request at one prompt batch (request.ubatch) and one
    copies-ahead choice (copy_ahead), the machine, the profile, and what follows from them."""

    info: ModelInfo
    trunk: ModelInfo
    request: PlanRequest
    machine: MachineFacts
    profile: Profile | None
    profile_path: Path | None
    copy_ahead: bool
    draft: SpecNeed
    costs: list[LayerCost]  # per trunk MoE layer
    load_mode: str  # "pinned" or "mmap" (estimates.choose_load_mode), and what it notes
    load_notes: list[str]

    @property
    def spec(self) -> Speculation | None:
        return self.request.spec

    @property
    def k(self) -> int:
        """Tokens a step verifies (speculation's draft tokens + 1; 1 without)."""
        return self.spec.tokens_per_step if self.spec is not None else 1

    @property
    def mtp(self) -> bool:
        return self.spec is not None and self.spec.kind == "mtp"

    @property
    def budget(self) -> int | list[int] | None:
        """One GPU's budget, one per GPU (two: a list), or None (no GPU); plan.make_plan unlists one GPU's."""
        return self.request.vram_budget

    @property
    def split_devices(self) -> list[SplitDevice] | None:
        """The devices the layers are split over, in llama.cpp's order (remote devices first, each at
        its budget: request.rpc_budget, else its free memory), where there are remote devices or two
        GPUs; None for one GPU or none."""
        budget, remote = self.budget, self.machine.remote
        local = budget if isinstance(budget, list) else [] if budget is None else [budget]
        prefix = self.machine.backend.device_prefix
        if not remote:
            return [SplitDevice(f"{prefix}{i}", b) for i, b in enumerate(local)] if len(local) > 1 else None
        asked = self.request.rpc_budget or []
        return ([SplitDevice(d.name, asked[i] if i < len(asked) else d.free_bytes, d.endpoint, d.free_bytes)
                 for i, d in enumerate(remote)] + [SplitDevice(f"{prefix}{i}", b) for i, b in enumerate(local)])

    @property
    def backend(self) -> Backend:
        """The build the plan runs on: the machine's GPU backend where it has a GPU to plan for, else the CPU."""
        return Backend.CPU if self.budget is None else self.machine.backend

    @property
    def nextn_slots(self) -> list[int]:
        """The MTP blocks' layers (last): every slot with an MTP draft, none otherwise."""
        return [self.info.n_expert if self.mtp else 0] * (len(self.info.layers) - len(self.trunk.layers))

    def partial(self, slots: list[int]) -> bool:
        return any(0 < n < self.info.n_expert for n in slots)


@dataclass
class Room:
    """What the GPU(s) hold beside the routed experts, and the room left for them."""

    non_expert: int
    kv_cache: int
    compute: int  # the compute buffer, with the copies ahead and the streamed misses' side tensors
    margin: int
    vram_source: str  # "estimate" (estimates.py) or "llama-fit-params"
    draft: SpecNeed | None = None  # the draft's share (two GPUs: summed over them; None: Setting.draft)
    devices: list[DevicePlan] | None = None  # two GPUs: per GPU
    tensor_split: list[int] | None = None


@dataclass
class Allocation:
    """Whole layers and slots per trunk MoE layer, and what placed them."""

    slots: list[int]
    stock_slots: list[int]  # stock --fit's placement at the same bytes
    room: int  # VRAM for the trunk's slots
    budget: int  # the budget, summed over the GPUs
    ahead: int = 0  # what the cache holds in VRAM beyond its slots: the copies ahead, the streamed misses' biases
    share: float = 0.0  # misses the GPU computes beside the CPU (allocate.stream_share)
    saving: float = 0.0
    prompt_factor: float = 1.0  # how much more prompt batches were weighed to keep them at stock's
    copy_ahead: bool = True
    split_args: list[str] = field(default_factory=list)
    remote_slots: bool = False  # a remote device holds slots (machine.rpc): they stay as profiled
    notes: list[str] = field(default_factory=list)  # what the allocation says of itself


def layer_costs(trunk: ModelInfo, profile: Profile | None, request: PlanRequest, machine: MachineFacts,
                copy_ahead: bool) -> list[LayerCost]:
    """Each trunk layer's cost curve: its hit curve, prompt batches priced for request.prompt_tokens
    (allocate.long_prompt_uploads, from the hit curves) or the profile's own prompts (prefill_uploads)."""
    curves = hit_curves(profile, len(trunk.layers), trunk.n_expert)
    k = request.spec.tokens_per_step if request.spec is not None else 1
    rate, prompts = None, None
    if request.prefill_weight > 0 and request.prompt_tokens and profile is not None:
        per_layer = [long_prompt_uploads(c, trunk.n_expert_used, request.prompt_tokens, request.ubatch)
                     for c in curves]
        prompts = (np.stack([u for u, _ in per_layer]), per_layer[0][1])
        rate = machine.costs.long_prompt_upload_bytes_per_s
    elif request.prefill_weight > 0:
        prompts = prefill_uploads(profile, len(trunk.layers), trunk.n_expert, request.ubatch)
    return [LayerCost(layer.bytes_per_expert, layer.n_expert, trunk.n_expert_used, curve, k,
                      prompts[0][i] if prompts else None, prompts[1] if prompts else 0.0, request.prefill_weight,
                      copy_ahead, rate, machine.costs)
            for i, (layer, curve) in enumerate(zip(trunk.layers, curves))]


def setting(info: ModelInfo, request: PlanRequest, machine: MachineFacts, profile: Profile | None,
            profile_path: Path | None, copy_ahead: bool) -> Setting:
    """The request checked against the model (one-line errors), and what every stage reads."""
    ubatch, spec = request.ubatch, request.spec
    if isinstance(request.vram_budget, list) and ubatch != DEFAULT_UBATCH:
        raise MoeplugError(f"--ubatch {ubatch}: one GPU only (two GPUs are planned for llama.cpp's {DEFAULT_UBATCH})")
    if machine.remote and ubatch != DEFAULT_UBATCH:
        raise MoeplugError(f"--ubatch {ubatch}: one GPU only (remote devices are planned for llama.cpp's "
                           f"{DEFAULT_UBATCH})")
    if spec is not None and spec.kind != "ngram" and ubatch > DEFAULT_UBATCH:
        # llama-server's draft context takes the server's batch sizes too (common_base_params_to_speculative),
        # and what a larger batch adds to a draft's or an MTP head's buffers was never measured
        raise MoeplugError(f"--ubatch {ubatch} with --spec {spec.kind}: not planned yet (the draft's buffers grow "
                           f"with the batch too); up to {DEFAULT_UBATCH}, or --spec ngram")
    if not info.layers:
        raise MoeplugError(f"{info.path}: no routed-expert tensors: a dense model, nothing for moeplug to plan")
    trunk = trunk_of(info)
    if not trunk.layers:
        raise MoeplugError(f"{info.path}: routed experts only in its MTP (NextN) blocks: nothing for moeplug to plan")
    draft = spec_need(info, spec, request.ctx, machine.draft_need, machine.costs)
    costs = layer_costs(trunk, profile, request, machine, copy_ahead)
    # pinned memory speeds up copies to a GPU of this machine: without one, or where the machine refuses it, mmap
    if request.vram_budget is None:
        load_mode, load_notes = "mmap", ()
    elif not machine.pinned:
        load_mode, load_notes = "mmap", (machine.pinned_note,) if machine.pinned_note else ()
    else:
        load_mode, load_notes = choose_load_mode(info, machine.ram_available)
    return Setting(info, trunk, request, machine, profile, profile_path, copy_ahead, draft, costs, load_mode,
                   list(load_notes))


def room_beside_experts(s: Setting) -> Room:
    """One GPU's buffers beside the experts: llama.cpp's own figure (machine.need, at its default
    prompt batch, plus what a larger one adds) or moeplug's estimate."""
    need, info, ubatch, c = s.machine.need, s.info, s.request.ubatch, s.machine.costs
    if need is not None:
        return Room(need.model, need.context, need.compute + ubatch_growth_bytes(info, ubatch, c), c.cuda_context_reserve,
                    "llama-fit-params")
    # with an MTP draft the NextN blocks' weights are the draft's; without one they count here
    # (llama.cpp skips some of them: hy_v3 still loads their FFN)
    nextn_other = nextn_weight_bytes(info) - (info.expert_bytes - s.trunk.expert_bytes) if s.mtp else 0
    return Room(info.non_expert_bytes - nextn_other, kv_cache_bytes(info, s.request.ctx),
                compute_buffer_bytes(info, ubatch) + c.cuda_pool_headroom, c.safety_margin, "estimate")


def copies_ahead_bytes(s: Setting, room: int) -> int:
    """What the cache's prompt batches hold beyond stock's in the compute buffer: a second weight copy
    for the copies ahead, which moeplug's estimate does not count and llama.cpp's (asked about stock's
    path) only partly; without them, what llama.cpp's figure misses of one copy. At most `room`."""
    c, need = s.machine.costs, s.machine.need
    if s.copy_ahead:
        ahead = expert_copy_ahead_bytes(s.trunk) if need is None else cache_compute_extra(s.trunk, c.cache_compute_extra)
    else:
        ahead = 0 if need is None else cache_compute_single_copy(s.trunk, c.cache_compute_extra)
    return min(ahead, room)  # less room than that: no slot, no cache


def allocate_one_gpu(s: Setting, room: Room) -> Allocation:
    """Slots in one GPU's room: the copies ahead off it where the cache will hold slots, the profile's
    allocation against stock's placement, the GPU's share of the misses where streaming pays; stock's
    placement where no layer ends up partly resident."""
    budget, expert_room, trunk = s.budget, s.machine.expert_room, s.trunk
    others = room.non_expert + room.kv_cache + room.compute + room.margin
    left = budget - others - s.draft.total if expert_room is None else expert_room - s.draft.total
    ahead = copies_ahead_bytes(s, left) if s.profile and 0 <= left < trunk.expert_bytes else 0
    room.compute += ahead
    others, left = others + ahead, left - ahead
    if left < 0:
        raise MoeplugError(no_room(budget, others if expert_room is None else budget - expert_room, s.draft,
                                   s.spec, s.request.ctx))
    stock_slots = whole_layers_first(trunk, left + ahead)  # --fit's placement; stock has no second copy
    slots, factor = (allocate_against_stock(s.costs, left, stock_slots) if s.profile
                     else (whole_layers_first(trunk, left), 1.0))
    notes = []
    demo = [min(s.request.slots_in_ram, trunk.n_expert)] * len(trunk.layers)
    if s.profile and demo[0] and sum(n * layer.bytes_per_expert for n, layer in zip(demo, trunk.layers)) <= left:
        # the demo's slots, whatever the cost model makes of a model this small: the path is what it shows
        slots, factor = demo, 1.0
        notes.append(f"the demo: {demo[0]} slots per layer on the GPU whatever the cost model says (its experts are too "
                     f"small for slots to pay), to show the path")
    alloc = Allocation(slots, stock_slots, left, budget, ahead, prompt_factor=factor, copy_ahead=s.copy_ahead,
                       notes=notes)
    if s.profile and s.partial(slots):
        streamed(s, alloc, room)
    if alloc.ahead and not s.partial(alloc.slots):
        # no partly resident layer: no cache, so no copies ahead; their bytes hold whole layers
        room.compute -= alloc.ahead
        alloc.slots, alloc.room, alloc.ahead, alloc.copy_ahead = stock_slots, alloc.room + alloc.ahead, 0, True
    return alloc


def streamed(s: Setting, alloc: Allocation, room: Room) -> None:
    """The GPU's share of the partly resident layers' misses (allocate.stream_share), where it saves
    enough, the experts are in pinned memory and the backend can: the slots re-allocated around the side
    tensors (biases, scales) the GPU's pass keeps in VRAM. Where it would pay but cannot be, the plan says why."""
    share, saving = stream_share(s.costs, alloc.slots)
    backend = s.machine.backend
    why = (f"{backend.label} cannot yet" if not backend.can_stream else
           "it needs pinned host memory, which this plan does not use" if not s.machine.pinned else None)
    if share and why:
        alloc.notes.append(f"no streamed misses (--moe-cache-stream): the GPU computing {share:.0%} of the partly "
                           f"resident layers' misses from RAM was modelled {1e3 * saving:.2f} ms less per token, but "
                           f"{why}")
        return
    if s.load_mode != "pinned":
        return
    side = expert_side_bytes(s.trunk.layers)
    if share and side:
        again, factor = (allocate_against_stock(s.costs, alloc.room - side, alloc.stock_slots) if alloc.room >= side
                         else ([], 1.0))
        share, saving = stream_share(s.costs, again) if again else (0.0, 0.0)
        if share:
            alloc.slots, alloc.prompt_factor, alloc.room, alloc.ahead = again, factor, alloc.room - side, alloc.ahead + side
            room.compute += side
    alloc.share, alloc.saving = share, saving


def allocate_split(s: Setting, devices: list[SplitDevice]) -> tuple[Room, Allocation]:
    """Each device's layers, whole layers and slots within its own budget (multi_gpu.py), summed: two
    GPUs, or remote devices (machine.rpc) before this machine's GPUs."""
    split = plan_split(s.info, s.trunk, s.request.ctx, devices, s.costs, s.profile is not None, s.spec, s.machine.costs,
                       s.machine.costs.rpc_hop_s)
    remote = list(dict.fromkeys(d.endpoint for d in devices if d.endpoint))  # one entry per rpc-server
    devices = split.devices
    total = {key: sum(getattr(d, key) for d in devices) for key in (
        "non_expert_bytes", "kv_cache_bytes", "compute_bytes", "margin_bytes", "draft_weights_bytes",
        "draft_kv_cache_bytes", "draft_compute_bytes")}
    draft = SpecNeed(total["draft_weights_bytes"], total["draft_kv_cache_bytes"], total["draft_compute_bytes"])
    room = Room(total["non_expert_bytes"], total["kv_cache_bytes"], total["compute_bytes"], total["margin_bytes"],
                "estimate", draft, devices, split.tensor_split)
    alloc = Allocation(split.slots_per_layer, whole_layers_first(s.trunk, split.room), split.room,
                       sum(d.budget_bytes for d in devices), copy_ahead=s.copy_ahead,
                       split_args=[*(["--rpc", ",".join(remote)] if remote else []), "-sm", "layer", "--tensor-split",
                                   ",".join(map(str, split.tensor_split))],
                       remote_slots=any(d.endpoint and d.slots for d in devices),
                       notes=[f"{d.device} ({d.endpoint}) holds no layer: a hop there and back "
                              f"({2e3 * s.machine.costs.rpc_hop_s:.2f} ms a step) is modelled to cost more than the "
                              f"layers it could hold save" for d in devices if d.endpoint and not d.blocks])
    return room, alloc


def no_room(budget: int, others: int, draft: SpecNeed, spec: Speculation | None, ctx: int) -> str:
    """The one line for a budget that holds no expert: what it does not hold, the draft named apart."""
    if draft.total and budget >= others:
        return (f"the budget of {human_bytes(budget)} does not hold the draft ({spec.describe() if spec else ''}): "
                f"{human_bytes(draft.total)} (weights {human_bytes(draft.weights)}, KV cache at {ctx} tokens "
                f"{human_bytes(draft.kv_cache)}, compute {human_bytes(draft.compute)}) beside the model's other "
                f"weights, KV cache and buffers ({human_bytes(others)}): lower --ctx, use a smaller draft, or plan "
                f"without --spec")
    also = f" and a draft of {human_bytes(draft.total)}" if draft.total else ""
    return (f"the budget of {budget / GIB:.2f} GiB does not hold the model's other weights, KV cache and buffers "
            f"({others / GIB:.2f} GiB{also}): lower --ctx or use a smaller quant")


@dataclass
class Flags:
    """llama-server's arguments for a placement, the cache's policy and what the plan notes."""

    args: list[str]
    notes: list[str]
    cache_policy: str = "static"
    offload_min_batch: int | None = None


def placement_flags(s: Setting, alloc: Allocation) -> Flags:
    """The arguments that place the experts: full offload, every expert on the CPU, or whole layers
    and slots (the cache's flags), with what each choice notes."""
    info, slots, n_trunk = s.info, alloc.slots, len(s.trunk.layers)
    all_slots = slots + s.nextn_slots
    args = ["-c", str(s.request.ctx), *ubatch_args(s.request.ubatch), "-ngl", "99", *alloc.split_args, "-fit", "off",
            *(["-lm", "none"] if s.load_mode == "pinned" else [])]
    flags = Flags(args, list(s.load_notes) + speculation_notes(s) + alloc.notes)
    whole = sum(n >= info.n_expert for n in slots)
    if whole == n_trunk:
        flags.args += placement_args(info, all_slots, s.profile, s.profile_path, ubatch=s.request.ubatch)
        flags.notes.append("every expert fits in VRAM: full offload, no cache needed")
    elif sum(slots) == 0 and not s.mtp:
        flags.args += ["--cpu-moe"]
        flags.notes.append("no room for one slot: every expert on the CPU (--cpu-moe)")
    elif sum(slots) == 0:  # --cpu-moe would take the MTP head's experts off the GPU too
        flags.args += experts_in_ram_args([layer.block for layer in s.trunk.layers])
        flags.notes.append("no room for one slot: every expert of the trunk on the CPU")
    else:
        dynamic = (s.partial(slots) and s.profile and s.request.policy in ("auto", "dynamic")
                   and s.machine.costs.dynamic_uploads > 0 and not alloc.remote_slots)
        flags.cache_policy = "dynamic" if dynamic else "static"
        flags.args += placement_args(info, all_slots, s.profile, s.profile_path, flags.cache_policy, s.request.ubatch,
                                     s.machine.costs.dynamic_uploads)
        flags.notes += placement_notes(s, alloc, whole, flags.cache_policy)
    return flags


def placement_notes(s: Setting, alloc: Allocation, whole: int, policy: str) -> list[str]:
    """What a plan with slots or whole layers in RAM says of its placement."""
    n_trunk, layers = len(s.trunk.layers), f"{whole} whole layer{'s' if whole != 1 else ''}"
    notes = []
    if alloc.remote_slots:
        notes.append("slots on remote devices stay as profiled (the static policy): the dynamic policy's uploads "
                     "would cross the network")
    if policy == "dynamic":
        notes.append("the slots follow the prompt (--moe-cache-policy dynamic): a hot missed expert replaces "
                     "the coldest resident one between batches, uploaded while the next tokens compute")
    if not s.profile and alloc.split_args:
        notes.append(f"no profile to choose slots: stock placement on each GPU, {layers} (each GPU's first), the "
                     f"experts of the other {n_trunk - whole} in RAM")
    elif not s.profile:
        notes.append(f"no profile to choose slots: stock placement, {layers} on the GPU, the experts of the last "
                     f"{n_trunk - whole} in RAM")
    elif whole and not s.partial(alloc.slots):
        notes.append(f"stock's placement, {layers} on the GPU and the experts of the last {n_trunk - whole} in RAM, "
                     f"no cache: slots spread over more layers were modelled no faster"
                     f"{', or slower to prefill' if alloc.prompt_factor > 1 else ''} (allocate.py, "
                     f"allocate_against_stock)")
    elif whole:
        notes.append(f"{layers} resident (no CPU pass): the profile's hit curves make {'them' if whole != 1 else 'it'} "
                     f"worth more than spreading the slots")
    return notes


def speculation_notes(s: Setting) -> list[str]:
    if not s.spec:
        return []
    return [f"speculative decoding: {s.spec.describe()}; slots spread for verification batches of {s.k} tokens"]


def lever_flags(s: Setting, alloc: Allocation, flags: Flags) -> None:
    """The levers after the placement: the prompt guard's note, speculation's, the GPU's share of the
    misses (--moe-cache-stream), the draft's flags, and short prompts to the GPU."""
    costs, slots, k = s.costs, alloc.slots, s.k
    if alloc.prompt_factor > 1 and s.partial(slots):
        flags.notes.append(
            f"prompt batches weighed {alloc.prompt_factor:g}x the prompt tokens per generated token planned for, so "
            f"that they stay at stock's modelled cost ({1e6 * modelled_prompt_seconds(costs, slots):.1f} against "
            f"{1e6 * modelled_prompt_seconds(costs, alloc.stock_slots, stock=True):.1f} us per prompt token): fewer "
            f"partly resident layers, less decode gain")
    if s.spec is not None and k > 1 and s.profile is not None:
        flags.notes += speculation_cost_note(costs, slots, k)
    if alloc.share:  # a share needs a partly resident layer, so the cache's flags are there
        flags.args += ["--moe-cache-stream", f"{alloc.share:g}"]
        flags.notes.append(
            f"the GPU computes the hottest missed experts carrying {alloc.share:.0%} of each partly resident layer's "
            f"misses from RAM while the CPU computes the rest (--moe-cache-stream {alloc.share:g}): modelled "
            f"{1e3 * alloc.saving:.2f} ms less host time per {'verification step' if k > 1 else 'token'}")
    flags.args += s.spec.server_args(gpu=True) if s.spec else []
    # one GPU only: on two the cache's device copy engages on the first alone (native/DESIGN.md), unmeasured; and
    # only where the GPU copies experts from the slots itself (CUDA)
    if ("--moe-cache-slots" in flags.args and not alloc.split_args and s.partial(slots)
            and s.machine.backend.can_copy_experts):
        short = flags.offload_min_batch = s.machine.costs.short_prompt_offload
        flags.args += [OFFLOAD_MIN_BATCH_FLAG, str(short)]
        flags.notes.append(f"short prompts go to the GPU from {short} tokens on, their missed experts copied over "
                           f"({OFFLOAD_MIN_BATCH_FLAG} {short}; llama.cpp sends batches below {MIN_UBATCH} tokens to "
                           f"the CPU, which computes every missed selection of each token)")


def backend_notes(s: Setting, alloc: Allocation, flags: Flags) -> list[str]:
    """What a plan with slots on a GPU whose backend lacks some of the cache's GPU paths says of them, in one
    line (nothing on CUDA, which has them all)."""
    missing = s.backend.missing()
    if not missing or "--moe-cache-slots" not in flags.args or not s.partial(alloc.slots):
        return []
    return [f"on {s.backend.label} the slots hold the hottest experts ({flags.cache_policy} policy) and the CPU "
            f"computes each layer's misses beside them; not on {s.backend.label} yet: {'; '.join(missing)}"]


def tokens_per_step(acceptance: float, n_draft: int) -> float:
    """Tokens one verification step yields when each drafted token is accepted with this
    probability after the ones before it: 1 + a + ... + a^n."""
    return float(sum(acceptance ** i for i in range(n_draft + 1)))


def speculation_cost_note(costs: list[LayerCost], slots: list[int], k: int) -> list[str]:
    """What a verification batch of k tokens costs on the host against one token with these slots
    (costs: the plan's, for batches of k; allocate.py: a batch reads the union of its tokens' missed
    experts), and the acceptance per drafted token it takes for drafts to pay that back, the
    draft's own time and prompts not counted; nothing where no expert is read from RAM."""
    decode = [replace(c, prefill=None) for c in costs]
    one = modelled_seconds([replace(c, tokens_per_step=1) for c in decode], slots)
    batch = modelled_seconds(decode, slots)
    if one <= 0:
        return []
    ratio = batch / one
    head = (f"speculation: a verification batch of {k} tokens is modelled at {ratio:.1f}x the host time of one "
            f"token with these slots (it reads the experts all {k} picked)")
    if tokens_per_step(1.0, k - 1) <= ratio:
        return [head + "; no acceptance pays for it where host time dominates"]
    lo, hi = 0.0, 1.0
    for _ in range(50):  # the acceptance at which a step yields `ratio` tokens
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_step(mid, k - 1) < ratio else (lo, mid)
    return [head + f"; drafts pay only where a step yields more than {ratio:.1f} tokens: above {hi:.2f} acceptance "
                   f"per drafted token, before the draft's own time"]


def fit_warnings(fit: float, hit: float | None) -> list[str]:
    pct = f"{fit:.0%}"
    expect = f"the profile predicts {hit:.0%} of expert selections served from VRAM" if hit is not None else \
        "no profile to predict the hit rate"
    if fit < WARN_FIT_STRONG:
        return [f"only {pct} of the experts fit in VRAM (below 15%): {expect}; expect decode close to "
                f"--cpu-moe speed, bound by the CPU. A smaller quant or a larger GPU helps more than the cache."]
    if fit < WARN_FIT:
        return [f"only {pct} of the experts fit in VRAM (below 20%): {expect}; most experts run on the CPU."]
    return []


def predicted_hit(costs: list[LayerCost], slots: list[int]) -> float:
    """Share of all selections served by the planned slots, from the hit curves."""
    return float(np.mean([c.hits[min(n, c.n_expert)] for c, n in zip(costs, slots)]))


@dataclass
class Placed:
    """The slots as the plan reports them (every MoE layer, the MTP blocks' last)."""

    slots_per_layer: list[int]
    whole_layers: int
    fit_fraction: float
    predicted_hit_rate: float | None
    expert_vram_bytes: int


def placed(s: Setting, slots: list[int], room: int | None) -> Placed:
    """slots: per trunk MoE layer; room: VRAM for the trunk's experts (None: a CPU plan, the share of
    the experts the slots hold)."""
    info, trunk = s.info, s.trunk
    all_slots = slots + s.nextn_slots
    fit = (min(room, trunk.expert_bytes) / trunk.expert_bytes if room is not None
           else sum(slots) / (info.n_expert * len(trunk.layers)))
    return Placed(all_slots, sum(n >= info.n_expert for n in all_slots), fit,
                  predicted_hit(s.costs, slots) if s.profile else None,
                  sum(n * layer.bytes_per_expert for n, layer in zip(slots, trunk.layers)))


def common_fields(s: Setting, room: Room) -> dict:
    """The Plan's fields every plan sets the same way."""
    draft = room.draft or s.draft
    return dict(model=str(s.info.path), ctx=s.request.ctx, non_expert_vram_bytes=room.non_expert,
                kv_cache_bytes=room.kv_cache, compute_bytes=room.compute, margin_bytes=room.margin,
                bytes_per_slot=bytes_per_slot(s.trunk), vram_source=room.vram_source, n_expert=s.info.n_expert,
                n_moe_layers=len(s.info.layers), profile=str(s.profile_path) if s.profile_path else None,
                speculation=s.spec.to_json() if s.spec else None, draft_weights_bytes=draft.weights,
                draft_kv_cache_bytes=draft.kv_cache, draft_compute_bytes=draft.compute, tokens_per_step=s.k,
                prefill_weight=s.request.prefill_weight, ubatch=s.request.ubatch)


def cpu_plan(s: Setting) -> Plan:
    """No GPU: every expert on the CPU; the demo holds slots in RAM anyway (--moe-cache-device CPU)
    to show the cache engage: same results as stock, no speedup. Pinned memory only speeds up copies
    to a GPU: without one, mmap."""
    info, n_trunk = s.info, len(s.trunk.layers)
    slots = [min(s.request.slots_in_ram, info.n_expert)] * len(info.layers)
    args = ["-c", str(s.request.ctx), *ubatch_args(s.request.ubatch), "-ngl", "0"]
    note, policy = "no NVIDIA GPU found: a CPU plan, every expert on the CPU, no slots", "static"
    if slots[0]:
        args += ["--moe-cache-slots", str(slots[0]), *SLOTS_IN_RAM_ARGS]
        args += ["--moe-cache-profile", str(s.profile_path)] if s.profile_path else []
        if s.profile_path and s.request.policy in ("auto", "dynamic") and s.machine.costs.dynamic_uploads > 0:
            policy = "dynamic"
            args += dynamic_args(s.machine.costs.dynamic_uploads)
        note = (f"no NVIDIA GPU: {slots[0]} slots per layer held in RAM (--moe-cache-device CPU) to show the "
                f"cache engage: same results as stock, no speedup")
    args += s.spec.server_args(gpu=False) if s.spec else []
    p = placed(s, slots[:n_trunk], None)
    room = room_beside_experts(s)
    return Plan(backend="cpu", vram_budget_bytes=None, stock_ncmoe=None, modelled_host_ms=None,
                stock_modelled_host_ms=None, server_args=args, notes=[note, *speculation_notes(s)],
                cache_policy=policy, slots_per_layer=slots, slots_total=sum(slots),
                whole_layers=sum(n >= info.n_expert for n in slots), fit_fraction=p.fit_fraction,
                predicted_hit_rate=p.predicted_hit_rate, expert_vram_bytes=0, load_mode="mmap",
                copy_ahead=s.copy_ahead, **common_fields(s, room))


def gpu_plan(s: Setting) -> Plan:
    """A plan for one GPU or two: room, allocation, flags, notes, and the modelled host time of its
    placement beside stock's."""
    devices = s.split_devices
    if devices is not None:
        room, alloc = allocate_split(s, devices)
    else:
        room = room_beside_experts(s)
        alloc = allocate_one_gpu(s, room)
    flags = placement_flags(s, alloc)
    lever_flags(s, alloc, flags)
    flags.notes += backend_notes(s, alloc, flags)
    p = placed(s, alloc.slots, alloc.room)
    costs, slots, stock_slots = s.costs, alloc.slots, alloc.stock_slots
    cache = "--moe-cache-slots" in flags.args  # without it, prompt batches take stock's path
    if not alloc.copy_ahead and s.backend.can_copy_ahead:  # a backend without them needs no switch
        flags.args += [COPY_AHEAD_FLAG, "off"]
    prompts = any(c.prefill is not None for c in costs)
    return Plan(
        backend=s.backend, vram_budget_bytes=alloc.budget, stock_ncmoe=stock_ncmoe(s.trunk, alloc.room + alloc.ahead),
        modelled_host_ms=1e3 * modelled_seconds(costs, slots, stock=not cache),
        stock_modelled_host_ms=1e3 * modelled_seconds(costs, stock_slots, stock=True), server_args=flags.args,
        modelled_prompt_us=1e6 * modelled_prompt_seconds(costs, slots, stock=not cache) if prompts else None,
        stock_modelled_prompt_us=1e6 * modelled_prompt_seconds(costs, stock_slots, stock=True) if prompts else None,
        prefill_guard=alloc.prompt_factor, stream_share=alloc.share, modelled_stream_saving_ms=1e3 * alloc.saving,
        offload_min_batch=flags.offload_min_batch, warnings=fit_warnings(p.fit_fraction, p.predicted_hit_rate),
        notes=flags.notes, cache_policy=flags.cache_policy, load_mode=s.load_mode, copy_ahead=alloc.copy_ahead,
        devices=room.devices, tensor_split=room.tensor_split, slots_per_layer=p.slots_per_layer,
        device_env=dict(s.machine.device_env),
        slots_total=sum(p.slots_per_layer), whole_layers=p.whole_layers, fit_fraction=p.fit_fraction,
        predicted_hit_rate=p.predicted_hit_rate, expert_vram_bytes=p.expert_vram_bytes, **common_fields(s, room))


def plan_once(info: ModelInfo, request: PlanRequest, machine: MachineFacts, profile: Profile | None,
              profile_path: Path | None, copy_ahead: bool) -> Plan:
    """The plan at request.ubatch (a number) with or without the copies ahead; the cost model it used
    kept with it where it is not the GPU machine's default."""
    s = setting(info, request, machine, profile, profile_path, copy_ahead)
    plan = cpu_plan(s) if s.budget is None and not machine.remote else gpu_plan(s)
    plan.cost_model = machine.costs.to_json() if machine.costs != DEFAULT_COSTS else None
    return plan
