"""The slot planner: how many experts of each MoE layer fit in the GPU budget, and the flags to run.

    plan = make_plan(info, PlanRequest(ctx=4096, vram_budget=12 * GIB), MachineFacts(cpu_cores=16), profile)

A `PlanRequest` (the user's choices) and `MachineFacts` (this machine, its costs) go in, one `Plan`
record comes out (record.py). The VRAM budget less what llama.cpp puts on the GPU anyway (the
model's other weights, the KV cache at the context size, the compute buffer, a margin) leaves room
for experts, which allocate.py spreads over the layers from the profile's hit curves; the same
bytes also give stock llama.cpp's placement, modelled beside it. stages.py makes one plan at one
prompt batch (room -> allocation -> flags -> notes); this module weighs the choices around it: the
prompt batch (--ubatch auto), the copies ahead, and the server's threads.

Two budgets (two GPUs, `--vram-budget 12GiB,12GiB`) plan each GPU's layers, whole layers and slots
within that GPU's budget, and pass the layer split as `-sm layer --tensor-split A,B` (multi_gpu.py;
llama.cpp's split arithmetic in split.py). With speculative decoding (speculation.py) the draft's
weights, KV cache and compute buffer come off the budget first, and the slots are spread for
verification batches of draft_max + 1 tokens.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from moeplug.core.errors import MoeplugError
from moeplug.core.output import human_bytes
from moeplug.machine.backend import CAPABILITIES
from moeplug.model.inspect import ModelInfo
from moeplug.planner.costs import DEFAULT_COSTS, CostModel
from moeplug.planner.estimates import DEFAULT_UBATCH
from moeplug.planner.record import PLANNER_REVISION, Plan
from moeplug.planner.request import UBATCH_AUTO, MachineFacts, PlanRequest
from moeplug.planner.server_flags import with_threads
from moeplug.planner.stages import plan_once
from moeplug.profile.format import Profile

# --ubatch auto (make_plan): the planner's choice of the server's prompt batch, among these; larger ones
# were never measured through the server (estimates.ubatch_growth_bytes was fitted at 2048)
UBATCH_CANDIDATES = (512, 1024, 2048)


def make_plan(info: ModelInfo, request: PlanRequest, machine: MachineFacts = MachineFacts(),
              profile: Profile | None = None, profile_path: Path | None = None) -> Plan:
    """The plan for a request on a machine. profile: the profile to plan from (None: read from
    profile_path, where given; a re-profile's preview passes the one it is about to store there);
    profile_path: the file the server reads (--moe-cache-profile). The request's ubatch, where the
    planner's (UBATCH_AUTO), is chosen among UBATCH_CANDIDATES (choose_ubatch); its copy_ahead, where
    the planner's (None), by plan_copies; its threads, where the planner's, by server_threads."""
    request.check()
    budget = request.vram_budget
    budget = budget[0] if isinstance(budget, list) and len(budget) == 1 else budget  # one GPU's, listed
    request = replace(request, vram_budget=budget, prompt_tokens=request.prompt_tokens or None)  # 0: the profile's
    if profile is None and profile_path:
        from moeplug.profile.format import read_profile

        profile = read_profile(profile_path)

    def planned(u: int) -> Plan:
        plan = plan_copies(info, replace(request, ubatch=u), machine, profile, profile_path)
        return threaded(plan, machine.cpu_cores, request.threads, machine.costs)

    if request.ubatch != UBATCH_AUTO:
        plan = planned(request.ubatch)
    else:
        plan = choose_ubatch(planned, ubatch_candidates(request, profile), request.prompt_tokens, machine.costs)
    plan.planner = PLANNER_REVISION
    plan.ubatch_asked, plan.prompt_tokens = request.ubatch, request.prompt_tokens
    plan.notes += list(machine.notes)
    plan.workload = request.workload
    return plan


def ubatch_candidates(request: PlanRequest, profile: Profile | None) -> tuple[int, ...]:
    """The prompt batches --ubatch auto weighs: llama.cpp's 512 alone unless prompts longer than it are
    planned for (prompt_tokens) on one GPU, with a profile to price their batches and prompts weighed, and
    no draft model or MTP head (stages.setting refuses those above 512); else each of UBATCH_CANDIDATES up
    to the first that holds a whole prompt."""
    budget, spec, prompt_tokens = request.vram_budget, request.spec, request.prompt_tokens
    if (not prompt_tokens or prompt_tokens <= DEFAULT_UBATCH or not isinstance(budget, int) or request.rpc or profile is None
            or request.prefill_weight <= 0 or (spec is not None and spec.kind != "ngram")):
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


def choose_ubatch(planned: Callable[[int], Plan], candidates: tuple[int, ...], prompt_tokens: int | None,
                  costs: CostModel = DEFAULT_COSTS) -> Plan:
    """The plan at the candidate prompt batch modelled fastest in all: decode per token plus prompt
    batches weighed by prompt tokens per generated token, at prompts of prompt_tokens tokens. A larger
    batch uploads the experts of the layers that are not whole fewer times per prompt token, and its
    activations (estimates.ubatch_growth_bytes) take VRAM from the slots, so decoding misses more: a
    larger one is chosen only where it is modelled costs.ubatch_min_gain faster than the smaller one chosen
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
        if _total_ms(p) < (1.0 - costs.ubatch_min_gain) * _total_ms(best):
            best = p
    if len(plans) > 1:
        base = plans[0]
        weighed = "; ".join(f"{p.ubatch}: {p.modelled_prompt_us or 0.0:.0f} us per prompt token, "
                            f"{_total_ms(p) - (p.prefill_weight * (p.modelled_prompt_us or 0.0) / 1e3):.2f} ms per "
                            f"{'step' if p.tokens_per_step > 1 else 'generated token'}" for p in plans)
        if best is base:
            best.notes.append(f"prompt batches of {base.ubatch} tokens, llama.cpp's default, kept for prompts of "
                              f"{prompt_tokens} tokens at {base.prefill_weight:g} prompt tokens per generated token: "
                              f"larger ones were not modelled {costs.ubatch_min_gain:.0%} faster in all ({weighed})")
        else:
            best.notes.append(f"prompt batches of {best.ubatch} tokens (-ub {best.ubatch}), chosen for prompts of "
                              f"{prompt_tokens} tokens at {best.prefill_weight:g} prompt tokens per generated token: "
                              f"fewer uploads per prompt token, for VRAM the slots give up ({weighed})")
    if unfit is not None:
        best.notes.append(f"prompt batches of {unfit} tokens or more were not weighed: their activations do not fit "
                          f"the budget beside the model's other buffers")
    return best


def server_threads(plan: Plan, cpu_cores: int | None, asked: int | None, costs: CostModel = DEFAULT_COSTS) -> int | None:
    """The -t a plan's server runs with, or None for llama.cpp's default (a thread per physical core).
    Asked (> 0): that. Otherwise, where the GPU's slots and the CPU's misses share a few partly resident
    layers (at most costs.server_threads_few_partial of the MoE layers), half the physical cores on a machine
    of costs.server_threads_min_cores or more: the CPU then computes a small share of each token, and with
    every core in the CPU backend's team, a team member that the OS has put aside for the thread driving
    the GPU, the HTTP server or anything else holds the whole team at the next barrier, so that prompt
    batches that took ~30 ms took ~25 ms more now and then (run 2026-12-03-timeline-threads). Where more
    layers are partly resident the CPU's share is larger and every core pays: half of them decoded 4-15%
    slower there (run 2026-12-03-threads-rule)."""
    if asked is not None:
        return asked or None
    partial = sum(0 < n < plan.n_expert for n in plan.slots_per_layer)
    if not plan.backend.gpu or not partial or "--moe-cache-slots" not in plan.server_args:
        return None
    if partial > costs.server_threads_few_partial * len(plan.slots_per_layer):
        return None
    return cpu_cores // 2 if cpu_cores and cpu_cores >= costs.server_threads_min_cores else None


def threaded(plan: Plan, cpu_cores: int | None, asked: int | None, costs: CostModel = DEFAULT_COSTS) -> Plan:
    """The plan with its server's thread count (server_threads) in its flags, its notes and `threads`."""
    n = server_threads(plan, cpu_cores, asked, costs)
    plan.threads, plan.threads_asked = n, asked
    if n is not None:
        plan.server_args = with_threads(plan.server_args, n)
        plan.notes.append(f"{n} CPU threads (-t {n}), as asked" if asked else
                          f"{n} CPU threads (-t {n}), half of the {cpu_cores} physical cores it may use: few layers are partly "
                          f"resident, so the CPU's share of a token is small, and a thread team on every core stalls "
                          f"prompt batches when the OS puts one member aside ('--threads N' to choose, 0 for "
                          f"llama.cpp's default)")
    return plan


def plan_copies(info: ModelInfo, request: PlanRequest, machine: MachineFacts, profile: Profile | None,
                profile_path: Path | None) -> Plan:
    """The plan at request.ubatch, with or without the copies ahead as asked, or the planner's choice:
    with them, unless the plan keeps at most CostModel.copy_ahead_few_partial of the MoE layers partly
    resident, where the bytes of their second weight copy go to slots instead (one GPU); never on a GPU
    backend without them (asked for there: a one-line error)."""
    def planned(ahead: bool) -> Plan:
        return plan_once(info, request, machine, profile, profile_path, ahead)

    gpu = machine.backend if request.vram_budget is not None else None
    if gpu is not None and not gpu.can_copy_ahead:
        if request.copy_ahead:
            raise MoeplugError(f"copies ahead: not on {gpu.label} yet ({CAPABILITIES['copy_ahead']}: CUDA only)")
        return planned(False)
    if request.copy_ahead is not None:
        return planned(request.copy_ahead)
    plan = planned(True)
    partial = sum(0 < n < info.n_expert for n in plan.slots_per_layer)
    if not plan.backend.gpu or plan.devices is not None or not partial or \
            partial > machine.costs.copy_ahead_few_partial * len(plan.slots_per_layer):
        return plan
    single = planned(False)
    if single.compute_bytes >= plan.compute_bytes:
        return plan  # nothing freed: keep the copies
    single.notes.append(f"{partial} of {len(plan.slots_per_layer)} MoE layers partly resident: prompt batches copy "
                        f"their expert weights one at a time, as stock's do, and the "
                        f"{human_bytes(plan.compute_bytes - single.compute_bytes)} a second weight copy would take "
                        f"hold slots (--moe-cache-copy-ahead off)")
    return single
