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

With speculative decoding (speculation.py) the draft's weights, KV cache and compute buffer come
off the budget first, and the slots are spread for verification batches of draft_max + 1 tokens.
A model's MTP (NextN) blocks are not the trunk's: llama.cpp runs them only for an MTP draft (and
skips some of their tensors otherwise; hy_v3 still loads their experts). So the slots are planned
over the trunk's MoE layers; an MTP block's layer gets every slot with `--spec mtp` (a whole layer
on the GPU, counted in the draft's weights) and none otherwise (its experts, if loaded, stay in
RAM, where nothing runs them). Before, the planner gave that layer slots like any other.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from moeplug.planner.allocate import (LONG_PROMPT_UPLOAD_BYTES_PER_S, PREFILL_WEIGHT, LayerCost, allocate_against_stock,
                              hit_curves, long_prompt_uploads, modelled_prompt_seconds, modelled_seconds,
                              prefill_uploads, stream_share)
from moeplug.core.errors import MoeplugError
from moeplug.planner.fit_estimate import CACHE_COMPUTE_EXTRA, CUDA_CONTEXT_RESERVE, DeviceNeed
from moeplug.planner.estimates import (
    CUDA_POOL_HEADROOM,
    DEFAULT_UBATCH,
    MIN_UBATCH,
    SAFETY_MARGIN,
    bytes_per_slot,
    cache_compute_extra,
    cache_compute_single_copy,
    choose_load_mode,
    compute_buffer_bytes,
    expert_copy_ahead_bytes,
    expert_side_bytes,
    kv_cache_bytes,
    stock_ncmoe,
    ubatch_growth_bytes,
    whole_layers_first,
)
from moeplug.model.inspect import ModelInfo
from moeplug.planner.multi_gpu import plan_split
from moeplug.core.output import human_bytes
from moeplug.profile.format import Profile
from moeplug.planner.server_flags import (DYNAMIC_ARGS, OFFLOAD_MIN_BATCH_FLAG, experts_in_ram_args, placement_args, ubatch_args,
                                  with_threads)
from moeplug.planner.speculation import SpecNeed, Speculation, nextn_blocks, nextn_weight_bytes, spec_need
from moeplug.core.sizes import GIB

WARN_FIT = 0.20
WARN_FIT_STRONG = 0.15
# --ubatch auto (make_plan): the planner's choice of the server's prompt batch, among these; larger ones
# were never measured through the server (estimates.ubatch_growth_bytes was fitted at 2048)
UBATCH_AUTO = 0
UBATCH_CANDIDATES = (512, 1024, 2048)
# a larger prompt batch is chosen only where its plan is modelled at least this much faster in all: the
# decode cost of its activations is modelled from host time alone, and measured up to 4x higher (gpt-oss
# shape at 50%, -ub 1024: 0.8 ms per token against 0.2 modelled; twenty-ninth session, native/BENCHMARKS.md)
UBATCH_MIN_GAIN = 0.05


def _layer_costs(info: ModelInfo, profile: Profile | None, tokens_per_step: int = 1,
                 prefill_weight: float = PREFILL_WEIGHT, copy_ahead: bool = True,
                 ubatch: int = DEFAULT_UBATCH, prompt_tokens: int | None = None) -> list[LayerCost]:
    """prompt_tokens: the prompt length to price prompt batches for (allocate.long_prompt_uploads, from
    the hit curves); None: the profile's own prompts (allocate.prefill_uploads)."""
    curves = hit_curves(profile, len(info.layers), info.n_expert)
    rate = None
    if prefill_weight <= 0:
        prompts = None
    elif prompt_tokens and profile is not None:
        per_layer = [long_prompt_uploads(curve, info.n_expert_used, prompt_tokens, ubatch) for curve in curves]
        prompts = (np.stack([u for u, _ in per_layer]), per_layer[0][1])
        rate = LONG_PROMPT_UPLOAD_BYTES_PER_S
    else:
        prompts = prefill_uploads(profile, len(info.layers), info.n_expert, ubatch)
    return [LayerCost(layer.bytes_per_expert, layer.n_expert, info.n_expert_used, curve, tokens_per_step,
                      prompts[0][i] if prompts else None, prompts[1] if prompts else 0.0, prefill_weight,
                      copy_ahead, rate)
            for i, (layer, curve) in enumerate(zip(info.layers, curves))]


def trunk_of(info: ModelInfo) -> ModelInfo:
    """The model without its MTP (NextN) blocks' MoE layers (the last ones): what the server runs per token."""
    nextn = nextn_blocks(info)
    return replace(info, layers=[layer for layer in info.layers if layer.block not in nextn]) if nextn else info


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
    modelled_host_ms: float | None  # host-side time per decoded token, prompts weighted (allocate.py's model)
    stock_modelled_host_ms: float | None  # the same for stock --fit's placement at this budget (the first layers whole)
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
    # speculative decoding (speculation.py): Speculation.to_json(), or None; what its draft holds on
    # the GPU (an MTP head: its NextN blocks, experts included; two GPUs: summed over them); the
    # slots were spread for batches of tokens_per_step tokens, and modelled_host_ms is per such
    # verification step
    speculation: dict[str, Any] | None = None
    draft_weights_bytes: int = 0
    draft_kv_cache_bytes: int = 0
    draft_compute_bytes: int = 0
    tokens_per_step: int = 1
    # prompt tokens per generated token the slots were spread for (allocate.py: prompt batches)
    prefill_weight: float = PREFILL_WEIGHT
    # what the layers not whole add to a prompt batch per prompt token (allocate.py's model), for these
    # slots and for stock's placement; None without prompt tokens in the profile
    modelled_prompt_us: float | None = None
    stock_modelled_prompt_us: float | None = None
    # how many times more prompt batches were weighed to keep them at stock's (allocate_against_stock)
    prefill_guard: float = 1.0
    # the share of the partly resident layers' misses the GPU computes beside the CPU (--moe-cache-stream;
    # allocate.stream_share), 0 for none, and what it is modelled to save per step
    stream_share: float = 0.0
    modelled_stream_saving_ms: float = 0.0
    # whether a prompt batch's later expert weights are copied while the split before computes (native
    # patch 0024, on by default); off, the compute buffer holds one weight copy as stock's does and the
    # bytes go to slots (the server then runs with GGML_SCHED_EXPERT_COPY_AHEAD=0: server_env)
    copy_ahead: bool = True
    # prompt batches of this many tokens or more go to the GPU with their missed experts copied over
    # (--moe-cache-offload-min-batch in server_args; SHORT_PROMPT_OFFLOAD), None for llama.cpp's
    # (estimates.MIN_UBATCH): set where the cache holds slots on one GPU
    offload_min_batch: int | None = None
    # the server's CPU threads (-t), None for llama.cpp's default (plan.server_threads); threads_asked:
    # what the user asked for (0: llama.cpp's default), None for the planner's choice (kept on re-plans)
    threads: int | None = None
    threads_asked: int | None = None
    # the planner's revision that made it (PLANNER_REVISION); 0: a record from before revisions
    planner: int = 0
    # the server's physical batch (-ub; make_plan): llama.cpp's 512 unless the user asked for another or the
    # planner chose a larger one for long prompts; ubatch_asked: what the user asked for, UBATCH_AUTO for the
    # planner's choice (kept on re-plans); prompt_tokens: the prompt length prompt batches were planned for,
    # None for the profile's own prompts (kept on re-plans)
    ubatch: int = DEFAULT_UBATCH
    ubatch_asked: int = UBATCH_AUTO
    prompt_tokens: int | None = None
    # the served traffic prefill_weight and prompt_tokens were learned from (moeplug reprofile:
    # traffic.Traffic.to_json()), kept on re-plans that do not set them; None: the user's or the defaults
    workload: dict[str, Any] | None = None

    @property
    def workload_source(self) -> str:
        """Where prefill_weight and prompt_tokens came from: "learned" (the served traffic, `workload`),
        "asked" (set by hand: values other than the defaults) or "default"."""
        if self.workload:
            return "learned"
        return "asked" if self.prefill_weight != PREFILL_WEIGHT or self.prompt_tokens else "default"

    def server_env(self) -> dict[str, str]:
        """The environment the plan's server runs with beside its flags."""
        return {} if self.copy_ahead else {"GGML_SCHED_EXPERT_COPY_AHEAD": "0"}

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
        if "ubatch_asked" not in doc and doc.get("ubatch", DEFAULT_UBATCH) != DEFAULT_UBATCH:
            # a record from before --ubatch auto: a ubatch other than 512 was asked for
            values["ubatch_asked"] = doc["ubatch"]
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


# the share of the MoE layers at or below which a plan's partly resident layers are few enough for the
# copies ahead to cost more than the slots their compute buffer would hold (patch 0024; nineteenth
# session, through the server, Qwen3 shape: 6 of 48 layers partly resident at 16 GiB, decode +5-8%
# without the copies and prefill at par; 29 of 48 at 12 GiB and 46 at 8 GiB, prefill 4-20% slower
# without and decode no faster; gpt-oss shape at 25%, 24 of 24: prefill 25% slower, decode +2.5%;
# checked again at 16 GiB in the twentieth and twenty-third sessions: with the copies ahead prefill
# -4% to +3%, decode 0-8% slower)
COPY_AHEAD_FEW_PARTIAL = 0.25
# raised when a change to the planner makes the plans it stored before worth making again: `moeplug serve`,
# `moeplug bench` and the hooks re-plan an installed model whose plan an older revision made, from its
# stored budget, context and choices (install.up_to_date; 1: the threads halved only where few layers are
# partly resident, twenty-seventh session; 2: short prompt batches on the GPU, SHORT_PROMPT_OFFLOAD; 3: the
# same through the server's flag, not its environment)
PLANNER_REVISION = 3
# With the cache's slots on a GPU, a prompt batch of this many tokens or more goes to the GPU: the slots
# serve their experts there and the missed ones are copied over, where llama.cpp sends a batch below 32
# tokens to the CPU, which computes every selection of a layer in RAM (the cache: every miss) for each
# token. Measured through the server (thirty-second session, native/BENCHMARKS.md; Qwen3 shape at 12
# GiB, 8 random prompts): 24 tokens at 16, prefill 2.15x of stock (first requests 1.83x) against 1.36x
# (first requests 0.88x) on the CPU; 12 tokens at 8, 2.14x (first requests 1.90x) against 1.15x (first
# requests 0.80x, lowest 0.66x) at 16; the gpt-oss shape at 25%, 24 tokens, 1.51x against 1.40x. Decode
# unchanged within the runs. Batches below it (a decoded token, a draft's verification batch of 4, a
# few parallel requests' step) keep the CPU beside the GPU; below 8 was not measured (native/DESIGN.md).
# The server takes it as a flag (server_flags.OFFLOAD_MIN_BATCH_FLAG) that applies to the cache's layers of
# that model alone, so router presets and Ollama's runners carry it per model.
SHORT_PROMPT_OFFLOAD = 8
SERVER_THREADS_MIN_CORES = 8  # below it, llama.cpp's default thread count (server_threads)
# the share of the MoE layers at or below which partly resident layers leave the CPU so little of a token
# that half the cores serve it better than all (server_threads; twenty-seventh session, through the server
# on the H200 box, 8 threads against 16 in one run: Qwen3 shape at 16 GiB, 6 of 48 layers partly resident,
# prefill +3-6% and decode -2% (twenty-sixth session); at 12 GiB, 29 of 48, decode 4-8% slower; at 8 GiB,
# 46 of 48, -7% to +8%; gpt-oss shape at 25% and 50%, 24 of 24, decode 5-15% and prefill 6-13% slower)
SERVER_THREADS_FEW_PARTIAL = 0.25


def make_plan(info: ModelInfo, ctx: int, vram_budget: int | list[int] | None, profile_path: Path | None = None,
              ram_available: int | None = None, slots_in_ram: int = 0, expert_room: int | None = None,
              need: DeviceNeed | None = None, policy: str = "auto", profile: Profile | None = None,
              spec: Speculation | None = None, draft_need: DeviceNeed | None = None,
              prefill_weight: float = PREFILL_WEIGHT, copy_ahead: bool | None = None,
              cpu_cores: int | None = None, threads: int | None = None, ubatch: int = UBATCH_AUTO,
              prompt_tokens: int | None = None) -> Plan:
    """The plan at a budget (_make_plan says what each argument is). copy_ahead: whether a prompt
    batch's later expert weights are copied while the split before computes (None: the planner's
    choice: on, unless the plan with them keeps at most COPY_AHEAD_FEW_PARTIAL of the MoE layers
    partly resident, where their second weight copy's bytes go to slots instead). cpu_cores: this
    machine's physical cores, no more than a CPU quota allows (probes.usable_cores); threads: the
    server's CPU threads as the user asked (0: llama.cpp's default; None: the planner's, server_threads).
    ubatch: the server's physical batch (-ub), the most prompt tokens one pass of the graph takes: a
    prompt batch uploads the experts of the layers not whole once per ubatch, so a larger one prefills
    a long prompt with fewer uploads per token, and the larger activations take VRAM from the slots
    (estimates.ubatch_growth_bytes beside need, llama.cpp's estimate at its default ubatch);
    UBATCH_AUTO: the planner's choice (choose_ubatch). prompt_tokens: the length of the prompts to
    plan prompt batches for (allocate.long_prompt_uploads); None: the profile's own prompts."""
    if ubatch != UBATCH_AUTO and ubatch < MIN_UBATCH:
        raise MoeplugError(f"--ubatch {ubatch}: at least {MIN_UBATCH} (a prompt batch below it is not offloaded)")
    if prompt_tokens is not None and prompt_tokens < 0:
        raise MoeplugError(f"--prompt-tokens {prompt_tokens}: 0 or more")
    prompt_tokens = prompt_tokens or None  # 0: the profile's own prompts
    if profile is None and profile_path:
        profile = _read_profile(profile_path)

    def planned(u: int) -> Plan:
        return threaded(_plan_copies(info, ctx, vram_budget, profile_path, ram_available, slots_in_ram, expert_room,
                                     need, policy, profile, spec, draft_need, prefill_weight, copy_ahead, u,
                                     prompt_tokens), cpu_cores, threads)

    if ubatch != UBATCH_AUTO:
        plan = planned(ubatch)
    else:
        plan = choose_ubatch(planned, ubatch_candidates(vram_budget, spec, profile, prefill_weight, prompt_tokens),
                             prompt_tokens)
    plan.planner = PLANNER_REVISION
    plan.ubatch_asked, plan.prompt_tokens = ubatch, prompt_tokens
    return plan


def ubatch_candidates(vram_budget: int | list[int] | None, spec: Speculation | None, profile: Profile | None,
                      prefill_weight: float, prompt_tokens: int | None) -> tuple[int, ...]:
    """The prompt batches --ubatch auto weighs: llama.cpp's 512 alone unless prompts longer than it are
    planned for (prompt_tokens) on one GPU, with a profile to price their batches and prompts weighed, and
    no draft model or MTP head (_make_plan refuses those above 512); else each of UBATCH_CANDIDATES up to
    the first that holds a whole prompt."""
    if isinstance(vram_budget, list) and len(vram_budget) == 1:
        vram_budget = vram_budget[0]
    if (not prompt_tokens or prompt_tokens <= DEFAULT_UBATCH or not isinstance(vram_budget, int) or profile is None
            or prefill_weight <= 0 or (spec is not None and spec.kind != "ngram")):
        return (DEFAULT_UBATCH,)
    out = []
    for u in UBATCH_CANDIDATES:
        out.append(u)
        if u >= prompt_tokens:
            break
    return tuple(out)


def _total_ms(plan: Plan) -> float:
    """A plan's modelled host time per step, prompts weighed, less what streaming misses saves."""
    return (plan.modelled_host_ms or 0.0) - plan.modelled_stream_saving_ms


def choose_ubatch(planned: Callable[[int], Plan], candidates: tuple[int, ...], prompt_tokens: int | None) -> Plan:
    """The plan at the candidate prompt batch modelled fastest in all: decode per token plus prompt
    batches weighed by prompt tokens per generated token, at prompts of prompt_tokens tokens. A larger
    batch uploads the experts of the layers that are not whole fewer times per prompt token, and its
    activations (estimates.ubatch_growth_bytes) take VRAM from the slots, so decoding misses more: a
    larger one is chosen only where it is modelled UBATCH_MIN_GAIN faster than the smaller one chosen
    so far; one whose buffers the budget cannot hold is left out, and the larger ones after it. The plan
    says what was weighed."""
    plans = [planned(candidates[0])]
    unfit = None
    for u in candidates[1:]:
        try:
            plans.append(planned(u))
        except MoeplugError:  # its activations do not fit beside the rest: nor do a larger batch's
            unfit = u
            break
    best = plans[0]
    for p in plans[1:]:
        if _total_ms(p) < (1.0 - UBATCH_MIN_GAIN) * _total_ms(best):
            best = p
    if len(plans) > 1:
        base = plans[0]
        weighed = "; ".join(f"{p.ubatch}: {p.modelled_prompt_us or 0.0:.0f} us per prompt token, "
                            f"{_total_ms(p) - (p.prefill_weight * (p.modelled_prompt_us or 0.0) / 1e3):.2f} ms per "
                            f"{'step' if p.tokens_per_step > 1 else 'generated token'}" for p in plans)
        if best is base:
            best.notes.append(f"prompt batches of {base.ubatch} tokens, llama.cpp's default, kept for prompts of "
                              f"{prompt_tokens} tokens at {base.prefill_weight:g} prompt tokens per generated token: "
                              f"larger ones were not modelled {UBATCH_MIN_GAIN:.0%} faster in all ({weighed})")
        else:
            best.notes.append(f"prompt batches of {best.ubatch} tokens (-ub {best.ubatch}), chosen for prompts of "
                              f"{prompt_tokens} tokens at {best.prefill_weight:g} prompt tokens per generated token: "
                              f"fewer uploads per prompt token, for VRAM the slots give up ({weighed})")
    if unfit is not None:
        best.notes.append(f"prompt batches of {unfit} tokens or more were not weighed: their activations do not fit "
                          f"the budget beside the model's other buffers")
    return best


def outdated(plan: Plan) -> bool:
    """Whether an older revision of the planner made this plan (PLANNER_REVISION)."""
    return plan.planner < PLANNER_REVISION


def server_threads(plan: Plan, cpu_cores: int | None, asked: int | None) -> int | None:
    """The -t a plan's server runs with, or None for llama.cpp's default (a thread per physical core).
    Asked (> 0): that. Otherwise, where the GPU's slots and the CPU's misses share a few partly resident
    layers (at most SERVER_THREADS_FEW_PARTIAL of the MoE layers), half the physical cores on a machine
    of SERVER_THREADS_MIN_CORES or more: the CPU then computes a small share of each token, and with
    every core in the CPU backend's team, a team member that the OS has put aside for the thread driving
    the GPU, the HTTP server or anything else holds the whole team at the next barrier, so that prompt
    batches that took ~30 ms took ~25 ms more now and then (the H200 box, 16 cores: native/BENCHMARKS.md,
    twenty-sixth session). Where more layers are partly resident the CPU's share is larger and every
    core pays: half of them decoded 4-15% slower there (twenty-seventh session)."""
    if asked is not None:
        return asked or None
    partial = sum(0 < n < plan.n_expert for n in plan.slots_per_layer)
    if plan.backend != "cuda" or not partial or "--moe-cache-slots" not in plan.server_args:
        return None
    if partial > SERVER_THREADS_FEW_PARTIAL * len(plan.slots_per_layer):
        return None
    return cpu_cores // 2 if cpu_cores and cpu_cores >= SERVER_THREADS_MIN_CORES else None


def threaded(plan: Plan, cpu_cores: int | None, asked: int | None) -> Plan:
    """The plan with its server's thread count (server_threads) in its flags, its notes and `threads`."""
    n = server_threads(plan, cpu_cores, asked)
    plan.threads, plan.threads_asked = n, asked
    if n is not None:
        plan.server_args = with_threads(plan.server_args, n)
        plan.notes.append(f"{n} CPU threads (-t {n}), as asked" if asked else
                          f"{n} CPU threads (-t {n}), half of the {cpu_cores} physical cores it may use: few layers are partly "
                          f"resident, so the CPU's share of a token is small, and a thread team on every core stalls "
                          f"prompt batches when the OS puts one member aside ('--threads N' to choose, 0 for "
                          f"llama.cpp's default)")
    return plan


def _plan_copies(info: ModelInfo, ctx: int, vram_budget: int | list[int] | None, profile_path: Path | None,
                 ram_available: int | None, slots_in_ram: int, expert_room: int | None, need: DeviceNeed | None,
                 policy: str, profile: Profile | None, spec: Speculation | None, draft_need: DeviceNeed | None,
                 prefill_weight: float, copy_ahead: bool | None, ubatch: int, prompt_tokens: int | None) -> Plan:
    """make_plan without the thread count: with or without the copies ahead, or the planner's choice."""
    def planned(ahead: bool) -> Plan:
        return _make_plan(info, ctx, vram_budget, profile_path, ram_available=ram_available, slots_in_ram=slots_in_ram,
                          expert_room=expert_room, need=need, policy=policy, profile=profile, spec=spec,
                          draft_need=draft_need, prefill_weight=prefill_weight, copy_ahead=ahead, ubatch=ubatch,
                          prompt_tokens=prompt_tokens)

    if copy_ahead is not None:
        return planned(copy_ahead)
    plan = planned(True)
    partial = sum(0 < n < info.n_expert for n in plan.slots_per_layer)
    if plan.backend != "cuda" or plan.devices is not None or not partial or \
            partial > COPY_AHEAD_FEW_PARTIAL * len(plan.slots_per_layer):
        return plan
    single = planned(False)
    if single.compute_bytes >= plan.compute_bytes:
        return plan  # nothing freed: keep the copies
    single.notes.append(f"{partial} of {len(plan.slots_per_layer)} MoE layers partly resident: prompt batches copy "
                        f"their expert weights one at a time, as stock's do, and the "
                        f"{human_bytes(plan.compute_bytes - single.compute_bytes)} a second weight copy would take "
                        f"hold slots (GGML_SCHED_EXPERT_COPY_AHEAD=0)")
    return single


def _make_plan(info: ModelInfo, ctx: int, vram_budget: int | list[int] | None, profile_path: Path | None = None,
              ram_available: int | None = None, slots_in_ram: int = 0, expert_room: int | None = None,
              need: DeviceNeed | None = None, policy: str = "auto", profile: Profile | None = None,
              spec: Speculation | None = None, draft_need: DeviceNeed | None = None,
              prefill_weight: float = PREFILL_WEIGHT, copy_ahead: bool = True,
              ubatch: int = DEFAULT_UBATCH, prompt_tokens: int | None = None) -> Plan:
    """profile: the profile at profile_path, read by make_plan unless the caller had read it already (a
    re-profile's preview plans from the profile it is about to store there). slots_in_ram: without a GPU, hold
    that many slots per layer in RAM anyway (the demo's stand-in for a GPU,
    LLAMA_MOE_CACHE_DEVICE=CPU: same results as stock, no speedup).
    expert_room: VRAM for experts when known better than the estimate (measured by llama.cpp's
    own fit, as the benchmark does). need: what llama.cpp's own estimate (fit_estimate.gpu_need)
    says the GPU holds beside the experts; the budget less that and the CUDA context is the
    experts' room. policy: the slot policy, "static", "dynamic" or "auto" (dynamic wherever a
    layer is partly resident: the hot experts move from prompt to prompt, and the swaps cost
    no results). vram_budget: bytes of one GPU, or a list of one per GPU (two: multi_gpu.py; need and
    expert_room apply to one GPU only). spec: speculative decoding (the draft's VRAM comes off the
    room, on two GPUs each GPU's share off its budget; the slots are spread for its verification
    batches); draft_need: llama.cpp's own estimate for a draft model (install.draft_need_for).
    prefill_weight: prompt tokens per generated token, what prompt batches weigh beside decoding
    (allocate.py; 0: decode only). copy_ahead: False plans for prompt batches that copy their expert
    weights one at a time, as stock does (one GPU; the freed compute buffer holds slots). ubatch (a number)
    and prompt_tokens: make_plan's."""
    if isinstance(vram_budget, list) and len(vram_budget) == 1:
        vram_budget = vram_budget[0]
    if isinstance(vram_budget, list) and ubatch != DEFAULT_UBATCH:
        raise MoeplugError(f"--ubatch {ubatch}: one GPU only (two GPUs are planned for llama.cpp's {DEFAULT_UBATCH})")
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
    draft = spec_need(info, spec, ctx, draft_need)
    mtp = spec is not None and spec.kind == "mtp"
    k = spec.tokens_per_step if spec is not None else 1
    per_slot = bytes_per_slot(trunk)
    kv = kv_cache_bytes(info, ctx) if need is None else need.context
    # need: llama.cpp's estimate at its default ubatch (install.plan_for), plus what a larger one adds
    compute = (compute_buffer_bytes(info, ubatch) + CUDA_POOL_HEADROOM if need is None
               else need.compute + ubatch_growth_bytes(info, ubatch))
    # with an MTP draft the NextN blocks' weights are the draft's; without one they count here as
    # before (llama.cpp skips some of them: hy_v3 still loads their FFN)
    nextn_other = nextn_weight_bytes(info) - (info.expert_bytes - trunk.expert_bytes) if mtp else 0
    non_expert = info.non_expert_bytes - nextn_other if need is None else need.model
    margin = SAFETY_MARGIN if need is None else CUDA_CONTEXT_RESERVE
    costs = _layer_costs(trunk, profile, k, prefill_weight, copy_ahead, ubatch, prompt_tokens)
    load_mode, load_notes = choose_load_mode(info, ram_available)
    n_layers = len(info.layers)
    n_trunk = len(trunk.layers)
    nextn_slots = [info.n_expert if mtp else 0] * (n_layers - n_trunk)  # the MTP blocks' layers, last
    base = dict(model=str(info.path), ctx=ctx, non_expert_vram_bytes=non_expert, kv_cache_bytes=kv,
                compute_bytes=compute, margin_bytes=margin, bytes_per_slot=per_slot,
                vram_source="estimate" if need is None else "llama-fit-params",
                n_expert=info.n_expert, n_moe_layers=n_layers, load_mode=load_mode,
                profile=str(profile_path) if profile_path else None,
                speculation=spec.to_json() if spec else None, draft_weights_bytes=draft.weights,
                draft_kv_cache_bytes=draft.kv_cache, draft_compute_bytes=draft.compute, tokens_per_step=k,
                prefill_weight=prefill_weight, copy_ahead=copy_ahead, ubatch=ubatch)
    batch_args = ubatch_args(ubatch)
    lm_args = ["-lm", "none"] if load_mode == "pinned" else []
    spec_notes = [f"speculative decoding: {spec.describe()}; slots spread for verification batches of {k} "
                  f"tokens"] if spec else []

    def summary(slots: list[int], room: int | None = None) -> dict[str, Any]:
        """slots: per trunk MoE layer; room: VRAM for the trunk's experts, fit_fraction is the share
        of all their bytes it holds"""
        all_slots = slots + nextn_slots
        all_experts = trunk.expert_bytes
        fit = min(room, all_experts) / all_experts if room is not None else sum(slots) / (info.n_expert * n_trunk)
        hit = _predicted_hit(costs, slots) if profile else None
        return dict(slots_per_layer=all_slots, slots_total=sum(all_slots),
                    whole_layers=sum(n >= info.n_expert for n in all_slots), fit_fraction=fit, predicted_hit_rate=hit,
                    expert_vram_bytes=sum(n * layer.bytes_per_expert for n, layer in zip(slots, trunk.layers)))

    if vram_budget is None:
        # pinned memory only speeds up copies to a GPU: without one, mmap
        slots = [min(slots_in_ram, info.n_expert)] * n_layers
        args = ["-c", str(ctx), *batch_args, "-ngl", "0"]
        note = "no NVIDIA GPU found: a CPU plan, every expert on the CPU, no slots"
        if slots[0]:
            args += ["--moe-cache-slots", str(slots[0])]
            args += ["--moe-cache-profile", str(profile_path)] if profile_path else []
            if profile_path and policy in ("auto", "dynamic"):
                base["cache_policy"] = "dynamic"
                args += DYNAMIC_ARGS
            note = (f"no NVIDIA GPU: {slots[0]} slots per layer held in RAM (LLAMA_MOE_CACHE_DEVICE=CPU) to show the "
                    f"cache engage: same results as stock, no speedup")
        args += spec.server_args(gpu=False) if spec else []
        cpu = summary(slots[:n_trunk]) | dict(slots_per_layer=slots, slots_total=sum(slots),
                                              whole_layers=sum(n >= info.n_expert for n in slots))
        return Plan(backend="cpu", vram_budget_bytes=None, stock_ncmoe=None, modelled_host_ms=None,
                    stock_modelled_host_ms=None, server_args=args, notes=[note, *spec_notes],
                    **(base | cpu | {"load_mode": "mmap", "expert_vram_bytes": 0}))

    split_args: list[str] = []
    ahead = 0  # what the cache holds in VRAM beyond its slots: the copies ahead, the streamed misses' biases
    share, saving = 0.0, 0.0  # misses the GPU computes beside the CPU (one GPU, pinned weights: allocate.stream_share)
    prompt_factor = 1.0  # how much more prompt batches were weighed to keep them at stock's (allocate.py)
    if isinstance(vram_budget, list):
        split = plan_split(info, trunk, ctx, vram_budget, costs, profile is not None, spec)
        room, slots = split.room, split.slots_per_layer
        devices = [d.to_json() for d in split.devices]
        sums = {key: sum(d[key] for d in devices) for key in
                ("kv_cache_bytes", "compute_bytes", "margin_bytes", "draft_weights_bytes", "draft_kv_cache_bytes",
                 "draft_compute_bytes")}
        base |= sums | dict(non_expert_vram_bytes=sum(d["non_expert_bytes"] for d in devices), devices=devices,
                            tensor_split=split.tensor_split, vram_source="estimate")
        split_args = ["-sm", "layer", "--tensor-split", ",".join(map(str, split.tensor_split))]
        vram_budget = sum(vram_budget)
        stock_slots = whole_layers_first(trunk, room)  # their rooms pooled
    else:
        others = non_expert + kv + compute + margin
        room = vram_budget - others - draft.total if expert_room is None else expert_room - draft.total
        if profile and 0 <= room < trunk.expert_bytes:
            # experts stay in RAM and the cache holds slots: the scheduler copies a prompt batch's
            # experts ahead, a second weight copy in the compute buffer that moeplug's estimate does not
            # count and llama.cpp's (need, asked about stock's path) only partly; without a profile:
            # stock's placement, no cache
            if copy_ahead:
                ahead = (expert_copy_ahead_bytes(trunk) if need is None
                         else cache_compute_extra(trunk, CACHE_COMPUTE_EXTRA))
            else:
                ahead = 0 if need is None else cache_compute_single_copy(trunk, CACHE_COMPUTE_EXTRA)
            ahead = min(ahead, room)  # less room than that: no slot, no cache
            base["compute_bytes"] = compute + ahead
            others += ahead
            room -= ahead
        if room < 0:
            raise MoeplugError(_no_room(vram_budget, others if expert_room is None else vram_budget - expert_room,
                                        draft, spec, ctx))
        stock_slots = whole_layers_first(trunk, room + ahead)  # --fit's placement; stock has no second copy
        slots, prompt_factor = (allocate_against_stock(costs, room, stock_slots) if profile
                                else (whole_layers_first(trunk, room), 1.0))
        if profile and load_mode == "pinned" and any(0 < n < info.n_expert for n in slots):
            share, saving = stream_share(costs, slots)
            side = expert_side_bytes(trunk.layers)  # the biases and scales the GPU's pass reads, kept in VRAM
            if share and side:
                again, factor = allocate_against_stock(costs, room - side, stock_slots) if room >= side else ([], 1.0)
                share, saving = stream_share(costs, again) if again else (0.0, 0.0)
                if share:
                    slots, prompt_factor, room, ahead = again, factor, room - side, ahead + side
                    base["compute_bytes"] += side
        if ahead and not any(0 < n < info.n_expert for n in slots):
            # no partly resident layer: no cache, so no copies ahead; their bytes hold whole layers
            slots, room, ahead = stock_slots, room + ahead, 0
            base["compute_bytes"] = compute
            base["copy_ahead"] = True
    ncmoe = stock_ncmoe(trunk, room + ahead)  # two GPUs: their rooms pooled
    s = summary(slots, room)
    args = ["-c", str(ctx), *batch_args, "-ngl", "99", *split_args, "-fit", "off", *lm_args]
    notes = list(load_notes) + spec_notes
    whole = sum(n >= info.n_expert for n in slots)
    if whole == n_trunk:
        args += placement_args(info, s["slots_per_layer"], profile, profile_path, ubatch=ubatch)  # an MTP block's experts in RAM
        notes.append("every expert fits in VRAM: full offload, no cache needed")
    elif sum(slots) == 0 and not mtp:
        args += ["--cpu-moe"]
        notes.append("no room for one slot: every expert on the CPU (--cpu-moe)")
    elif sum(slots) == 0:  # --cpu-moe would take the MTP head's experts off the GPU too
        args += experts_in_ram_args([layer.block for layer in trunk.layers])
        notes.append("no room for one slot: every expert of the trunk on the CPU")
    else:
        partial = any(0 < n < info.n_expert for n in slots)
        base["cache_policy"] = "dynamic" if partial and profile and policy in ("auto", "dynamic") else "static"
        args += placement_args(info, s["slots_per_layer"], profile, profile_path, base["cache_policy"], ubatch)
        if base["cache_policy"] == "dynamic":
            notes.append("the slots follow the prompt (--moe-cache-policy dynamic): a hot missed expert replaces "
                         "the coldest resident one between batches, uploaded while the next tokens compute")
        if not profile and split_args:
            notes.append(f"no profile to choose slots: stock placement on each GPU, {whole} whole layer"
                         f"{'s' if whole != 1 else ''} (each GPU's first), the experts of the other "
                         f"{n_trunk - whole} in RAM")
        elif not profile:
            notes.append(f"no profile to choose slots: stock placement, {whole} whole layer{'s' if whole != 1 else ''} "
                         f"on the GPU, the experts of the last {n_trunk - whole} in RAM")
        elif whole and not partial:
            notes.append(f"stock's placement, {whole} whole layer{'s' if whole != 1 else ''} on the GPU and the "
                         f"experts of the last {n_trunk - whole} in RAM, no cache: slots spread over more layers "
                         f"were modelled no faster{', or slower to prefill' if prompt_factor > 1 else ''} "
                         f"(allocate.py, allocate_against_stock)")
        elif whole:
            notes.append(f"{whole} whole layer{'s' if whole != 1 else ''} resident (no CPU pass): the profile's "
                         f"hit curves make {'them' if whole != 1 else 'it'} worth more than spreading the slots")
    if prompt_factor > 1 and any(0 < n < info.n_expert for n in slots):
        notes.append(f"prompt batches weighed {prompt_factor:g}x the prompt tokens per generated token planned for, "
                     f"so that they stay at stock's modelled cost ({1e6 * modelled_prompt_seconds(costs, slots):.1f} "
                     f"against {1e6 * modelled_prompt_seconds(costs, stock_slots, stock=True):.1f} us per prompt "
                     f"token): fewer partly resident layers, less decode gain")
    if spec is not None and k > 1 and profile is not None:
        notes += _speculation_note(costs, slots, k)
    if share:  # a share needs a partly resident layer, so the cache's flags are there
        args += ["--moe-cache-stream", f"{share:g}"]
        notes.append(f"the GPU computes the hottest missed experts carrying {share:.0%} of each partly resident "
                     f"layer's misses from RAM while the CPU computes the rest (--moe-cache-stream {share:g}): "
                     f"modelled {1e3 * saving:.2f} ms less host time per {'verification step' if k > 1 else 'token'}")
    args += spec.server_args(gpu=True) if spec else []
    prompts = any(c.prefill is not None for c in costs)
    cache = "--moe-cache-slots" in args  # without it, prompt batches take stock's path
    # one GPU only: on two the cache's device copy engages on the first alone (native/DESIGN.md), unmeasured
    short = SHORT_PROMPT_OFFLOAD if cache and not split_args and any(0 < n < info.n_expert for n in slots) else None
    if short:
        args += [OFFLOAD_MIN_BATCH_FLAG, str(short)]
        notes.append(f"short prompts go to the GPU from {short} tokens on, their missed experts copied over "
                     f"({OFFLOAD_MIN_BATCH_FLAG} {short}; llama.cpp sends batches below {MIN_UBATCH} tokens to the "
                     f"CPU, which computes every missed selection of each token)")
    return Plan(backend="cuda", vram_budget_bytes=vram_budget, stock_ncmoe=ncmoe,
                modelled_host_ms=1e3 * modelled_seconds(costs, slots, stock=not cache),
                stock_modelled_host_ms=1e3 * modelled_seconds(costs, stock_slots, stock=True), server_args=args,
                modelled_prompt_us=1e6 * modelled_prompt_seconds(costs, slots, stock=not cache) if prompts else None,
                stock_modelled_prompt_us=1e6 * modelled_prompt_seconds(costs, stock_slots, stock=True) if prompts else None,
                prefill_guard=prompt_factor, stream_share=share, modelled_stream_saving_ms=1e3 * saving,
                offload_min_batch=short, warnings=_fit_warnings(s["fit_fraction"], s["predicted_hit_rate"]),
                notes=notes, **(base | s))


def tokens_per_step(acceptance: float, n_draft: int) -> float:
    """Tokens one verification step yields when each drafted token is accepted with this
    probability after the ones before it: 1 + a + ... + a^n."""
    return float(sum(acceptance ** i for i in range(n_draft + 1)))


def _speculation_note(costs: list[LayerCost], slots: list[int], k: int) -> list[str]:
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


def _no_room(budget: int, others: int, draft: SpecNeed, spec: Speculation | None, ctx: int) -> str:
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
