"""`moeplug install MODEL`: reference -> files -> inspection -> native build -> profile -> plan ->
a running, verified llama-server, its record kept with the installed models (moeplug.serving.installed).

`install` reports progress through a callback and returns an `Installed` result; nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError, NotApplicableError
from moeplug.hooks import refresh_hooks
from moeplug.model.inspect import ModelInfo, inspect_model
from moeplug.planner.estimates import context_size
from moeplug.machine.gpu import gpus, one_budget_note, vram_budgets
from moeplug.core.output import human_bytes
from moeplug.planner.plan import make_plan
from moeplug.planner.record import Plan, outdated
from moeplug.planner.costs import DEFAULT_COSTS, CostModel
from moeplug.planner.request import COSTS_FITTED, MachineFacts, PlanChoices, PlanRequest
from moeplug.planner.server_flags import stock_args
from moeplug.profile.format import Profile
from moeplug.machine.backend import Backend
from moeplug.machine.probes import available_ram_bytes, pinned_memory, pinned_refusal_marker, usable_cores
from moeplug.profile.runner import DEFAULT_PROMPT_SETS
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.model.refs import ModelRef, ResolvedModel, parse_ref, resolve_ref
from moeplug.serving.installed import (InstalledModel, Verdict, list_installed, model_name, read_installed,
                                       write_installed)
from moeplug.serving.launch import ServeOptions
from moeplug.serving.server import exposure_warning
from moeplug.planner.speculation import Speculation

DEMO_PROFILE_TOKENS = 32
PROFILE_CTX = 2048  # the profiler's context: each prompt is one sequence, far shorter than this


@dataclass
class Installed:
    """What `install` did: the model's files, its profile and build, the plan, the server (or None)."""

    name: str
    model: str
    profile: str
    build_id: str
    plan: Plan
    server: Any = None  # a serving.ServerRecord when served
    verdict: Verdict | None = None  # the check against stock here (operations.check), where it ran

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "profile": self.profile, "build_id": self.build_id,
                "plan": self.plan.to_json(), "server": self.server.to_json() if self.server else None,
                "verdict": self.verdict.to_json() if self.verdict else None}


def locate(text: str, download: bool = True, progress: ProgressFn = silent) -> ResolvedModel:
    """The model's local files: generated (demo), found, or downloaded."""
    ref = parse_ref(text)
    if ref.kind == "demo":
        from moeplug.model.demo import ensure_demo_model

        ensure_demo_model(progress)
        return resolve_ref(text)
    if ref.kind == "hf" and download:
        from moeplug.model.download import fetch_hf

        return fetch_hf(ref, progress)
    return resolve_ref(text)


def require_moe(info: ModelInfo) -> None:
    if not info.layers:
        raise NotApplicableError(f"{info.path}: a dense model (no routed-expert tensors): moeplug has nothing to "
                                 f"offload; run it with stock llama.cpp")


def ensure_profile(model: Path, tool: Path, n_predict: int, prompt_sets: list[str], *, remake: bool = False,
                   progress: ProgressFn = silent) -> Path:
    """The model's stored profile, made with the bundled prompts when there is none yet (remake:
    made again, replacing it atomically)."""
    from moeplug.profile.format import model_fingerprint
    from moeplug.profile.runner import ProfileRun, default_profile_path, run_profile

    dest = default_profile_path(model_fingerprint(model))
    if dest.exists() and not remake:
        progress(Note(f"profile: {dest} (already made; 'moeplug profile' re-makes it)"))
        return dest
    run = ProfileRun(tool=tool, model=model, n_predict=n_predict, ctx=PROFILE_CTX)
    path, _ = run_profile(run, prompt_sets, dest, progress)
    return path


def rerun_prompts(m: InstalledModel, out: Path, progress: ProgressFn = silent) -> Profile:
    """An installed model's routing on the bundled prompt sets and its own prompt files, profiled
    as install profiles it, written to `out` (not stored as the model's profile)."""
    from moeplug.profile.runner import ProfileRun, run_profile

    tool = installed_build(m).binary("llama-moe-profile")
    run = ProfileRun(tool=tool, model=Path(m.path), n_predict=default_profile_tokens(parse_ref(m.ref)), ctx=PROFILE_CTX)
    return run_profile(run, [*DEFAULT_PROMPT_SETS, *m.prompt_files], out, progress)[1]


def default_profile_tokens(ref: ModelRef) -> int:
    """Tokens generated per profiling prompt: fewer for the demo's random weights."""
    return DEMO_PROFILE_TOKENS if ref.kind == "demo" else 256


def remake_profile(name: str, prompt_sets: list[str] | None = None, progress: ProgressFn = silent) -> Path:
    """Profile an installed model again with its build and the bundled prompts (the dashboard's
    re-profile); the stored profile is replaced atomically. Re-plan to use it."""
    from moeplug.profile.runner import DEFAULT_PROMPT_SETS

    m = read_installed(name)
    tool = installed_build(m).binary("llama-moe-profile")
    return ensure_profile(Path(m.path), tool, default_profile_tokens(parse_ref(m.ref)),
                          list(prompt_sets or DEFAULT_PROMPT_SETS), remake=True, progress=progress)


def probe_machine(info: ModelInfo, request: PlanRequest, build: Any = None,
                  progress: ProgressFn = silent) -> tuple[PlanRequest, MachineFacts]:
    """This machine's facts for a plan, probed once: free RAM, usable cores, the costs (a calibration
    file the request names, else this machine's own calibration for the build, made now where it has
    a GPU and none yet, else the GPU machine's figures), and where it plans for one GPU, llama.cpp's own
    figure for what that GPU holds beside the experts (the build's llama-fit-params; without a build,
    moeplug's estimate). The request comes back with its budget resolved (None: each GPU's free VRAM;
    still None without a GPU: a CPU plan)."""
    from moeplug.planner.fit_estimate import gpu_need

    found, backend, device_env, device_notes = machine_gpus(build, progress)
    budget = vram_budgets(request.vram_budget, found)
    one_gpu = budget is not None and not isinstance(budget, list)
    fit_tool = build.binary("llama-fit-params") if build is not None else None
    need = gpu_need(fit_tool, info.path, request.ctx) if fit_tool is not None and one_gpu else None
    note = one_budget_note(budget, found)
    remote, remote_notes = remote_for(request, build, progress)
    pinned, pinned_note = pinned_memory(pinned_refusal_marker())
    facts = MachineFacts(ram_available=available_ram_bytes(), cpu_cores=usable_cores(), need=need,
                         draft_need=draft_need_for(request.spec, request.ctx, fit_tool if one_gpu else None),
                         costs=machine_costs(request, build, bool(found), progress, info.path),
                         notes=((note,) if note else ()) + device_notes + remote_notes, remote=remote,
                         backend=backend, pinned=pinned, pinned_note=pinned_note, device_env=device_env)
    return replace(request, vram_budget=budget), facts


def machine_gpus(build: Any, progress: ProgressFn = silent) -> tuple[list[Any], Backend, tuple[tuple[str, str], ...],
                                                                      tuple[str, ...]]:
    """The GPUs a plan for `build` may use, the backend they run on, the environment the server needs to
    see them and what the plan says of them: NVML's GPUs, else (a GPU build) the devices llama.cpp lists
    (machine.devices): an AMD or Intel card through Vulkan, or a software Vulkan device named by index."""
    from moeplug.machine.devices import listed_gpus

    gpu_build = build is not None and getattr(build, "backend", Backend.CPU).gpu
    backend = build.backend if gpu_build else Backend.CUDA
    found = gpus()
    if found or not gpu_build:
        return found, backend, (), ()
    listed = listed_gpus(build.binary("llama-server"), build.backend)
    notes: tuple[str, ...] = ()
    if listed.software:
        g = listed.gpus[0]
        notes = (f"{g.device} is {g.name}, a Vulkan driver that runs on the CPU: llama.cpp uses it only when named "
                 f"({', '.join(f'{k}={v}' for k, v in listed.env.items())}, which the server gets); same results, "
                 f"no speedup",)
        progress(Note(notes[0]))
    return listed.gpus, backend, tuple(listed.env.items()), notes


def remote_for(request: PlanRequest, build: Any, progress: ProgressFn = silent) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """The devices of the request's rpc-servers as llama.cpp lists them with `build` (else the newest
    patched build here), and what the plan says of them: a warning for each server beyond loopback and
    private networks (rpc-server has no authentication)."""
    from moeplug.machine.rpc import exposure, parse_rpc, remote_devices

    if not request.rpc:
        return (), ()
    hosts = parse_rpc(",".join(request.rpc))
    server = (build or rpc_build()).binary("llama-server")
    progress(Note(f"asking {', '.join(request.rpc)} for the devices they serve"))
    devices = tuple(remote_devices(server, hosts))
    if request.rpc_budget and len(request.rpc_budget) > len(devices):
        raise MoeplugError(f"--rpc-budget gives {len(request.rpc_budget)} budgets but the rpc-servers offer "
                           f"{len(devices)} device{'s' if len(devices) != 1 else ''}: one per remote device")
    warnings = tuple(w for w in (exposure(h.host) for h in hosts) if w)
    for w in warnings:
        progress(Note(w))
    return devices, warnings


def rpc_build() -> Any:
    """The newest patched, unsanitized build here with ggml-rpc-server (what lists remote devices when
    no model's build is at hand), or an error saying how to make one."""
    from moeplug.serving.rpc_server import rpc_builds

    found = rpc_builds()
    if not found:
        raise MoeplugError("--rpc: no build with llama.cpp's RPC backend here: run 'moeplug native build' first")
    return max(found, key=lambda b: b.path.stat().st_mtime)


def machine_costs(request: PlanRequest, build: Any, has_gpu: bool, progress: ProgressFn = silent,
                  model: Path | None = None) -> CostModel:
    """The costs a plan uses (operations.calibrate.costs_for): the fitted figures where the request asks
    for them (PlanRequest.costs), a calibration file it names, else this machine's own. On a machine
    with a GPU whose calibration for this build is missing, was measured on the demo model or by an
    older moeplug (calibrate.remeasure_reason), `model` (a real one, not the demo) is measured now, once:
    the GPU's figures are what a plan's choices turn on."""
    from moeplug.model.demo import demo_model_path
    from moeplug.operations.calibrate import calibrate, costs_for, remeasure_reason, stored_calibration, write_calibration

    if request.costs == COSTS_FITTED:
        return DEFAULT_COSTS
    path = Path(request.calibration) if request.calibration else None
    build = build if getattr(build, "build_id", None) else None  # a build given by its folder alone: no calibration
    real = model is not None and model.name != demo_model_path().name
    if path is None and has_gpu and build is not None and real:
        why = remeasure_reason(stored_calibration(build))
        if why is not None:
            progress(Note(f"calibrating this machine with {model.name}: {why} ('moeplug calibrate' shows it)"))
            write_calibration(calibrate(build, model, progress=progress))
    return costs_for(build, path)


def plan_for(info: ModelInfo, request: PlanRequest, profile: Path | None, loaded: Profile | None = None,
             build: Any = None, progress: ProgressFn = silent) -> Plan:
    """The plan for a request on this machine (probe_machine). profile: the profile file the server
    reads; loaded: the profile to plan from when it is not (yet) that file; build: the native build
    it will run on (its llama-fit-params and calibration; None: moeplug's own estimates)."""
    request, machine = probe_machine(info, request, build, progress)
    return make_plan(info, request, machine, loaded, profile)


def demo_slots(info: ModelInfo, demo: bool) -> int:
    """Slots per layer the demo holds (in RAM without a GPU, on it with one), a quarter of its experts; 0: not the
    demo."""
    return max(1, info.n_expert // 4) if demo else 0


def demo_budget(info: ModelInfo, ctx: int, backend: Backend) -> int:
    """The demo's budget on a GPU where none is given: what the GPU holds beside the experts (moeplug's
    estimate) and a quarter of the expert bytes, so that the tiny model keeps most experts in RAM and the
    slots show, as on a consumer GPU (any GPU holds all of it)."""
    whole = make_plan(info, PlanRequest(ctx, 1 << 50), MachineFacts(backend=backend))
    other = whole.non_expert_vram_bytes + whole.kv_cache_bytes + whole.compute_bytes + whole.margin_bytes
    return other + info.expert_bytes // 4


def draft_need_for(spec: Speculation | None, ctx: int, fit_tool: Path | None) -> Any:
    """llama.cpp's own estimate of what a speculative draft model holds on the GPU (a DeviceNeed), or
    None: no draft model, no tool, or no GPU (the planner then estimates it itself)."""
    from moeplug.planner.fit_estimate import gpu_need

    if spec is None or spec.kind != "draft" or fit_tool is None:
        return None
    return gpu_need(fit_tool, Path(str(spec.draft)), ctx, experts_in_ram=False)


def installed_build(m: InstalledModel) -> Any:
    """The native build a model was installed with (a BuildResult), or an error saying what to do."""
    from moeplug.native.build import installed_builds

    builds = {b.build_id: b for b in installed_builds()}
    if m.build_id not in builds:
        raise MoeplugError(f"the build {m.build_id} that '{m.name}' was installed with is gone; "
                           f"run 'moeplug install {m.ref}' again")
    return builds[m.build_id]


def install(text: str, choices: PlanChoices = PlanChoices(), *, backend: str | None = None, jobs: int = 0,
            profile_tokens: int | None = None, prompt_sets: list[str] | None = None,
            progress: ProgressFn = silent) -> tuple[Installed, Any]:
    """Install a model: found or fetched, inspected, built for, profiled and planned for the choices
    given (a context None: 4096, or less for a model trained with less; above the training context
    only with ctx_override), its record written with the choices so that re-plans start from them.
    backend, jobs: the native build's; profile_tokens, prompt_sets: the profiler's. Returns what was
    installed and its build; operations.actions.install checks and serves it."""
    from moeplug.serving.launch import model_lock

    name = model_name(parse_ref(text))
    with model_lock(name, progress):
        record, build = installed_record(text, choices, backend, jobs, profile_tokens, prompt_sets, progress)
    return Installed(name=name, model=record.path, profile=str(record.profile), build_id=record.build_id,
                     plan=record.plan), build


def installed_record(text: str, choices: PlanChoices, backend: str | None, jobs: int, profile_tokens: int | None,
                     prompt_sets: list[str] | None, progress: ProgressFn) -> tuple[InstalledModel, Any]:
    """The model found or fetched, inspected, built for, profiled and planned, its record written and
    the hooks refreshed; and its build. The caller holds the model's lock."""
    from moeplug.machine.rpc import check_hosts
    from moeplug.native.build import build, resolve_options

    ref = parse_ref(text)
    check_hosts(choices.rpc or ())  # before the long steps
    resolved = locate(text, progress=progress)
    info = inspect_model(resolved.path)
    require_moe(info)
    ctx = context_size(info, choices.ctx, choices.ctx_override)
    progress(Note(f"{model_name(ref)}: {info.arch}, {len(info.layers)} MoE layers x {info.n_expert} experts "
                  f"({info.n_expert_used} used), {human_bytes(info.total_bytes)} at {resolved.path}"))
    result = build(resolve_options(backend, stock=False, jobs=jobs, cuda_arch=None), progress=progress)
    profile = ensure_profile(resolved.path, result.binary("llama-moe-profile"),
                             profile_tokens or default_profile_tokens(ref),
                             list(prompt_sets or DEFAULT_PROMPT_SETS), progress=progress)
    slots_on_cpu = ref.kind == "demo" and not result.backend.gpu
    if ref.kind == "demo" and result.backend.gpu and choices.vram_budget is None:
        choices = replace(choices, vram_budget=demo_budget(info, ctx, result.backend))
    request = choices.over(PlanRequest(ctx, slots_in_ram=demo_slots(info, ref.kind == "demo")), ctx)
    plan = plan_for(info, request, profile, build=result, progress=progress)
    record = InstalledModel(name=model_name(ref), ref=text, path=str(resolved.path), profile=str(profile),
                            build_id=result.build_id, ctx=ctx, plan=plan,
                            slots_on_cpu=slots_on_cpu and not plan.backend.gpu and not plan.devices,
                            request=replace(request, vram_budget=plan.budget))
    record = replace(record, plan=record.with_slots_in_ram(plan))
    write_installed(record)
    refresh_hooks(list_installed(), progress)
    return record, result


def launch_installed(m: InstalledModel, build: Any, serving: ServeOptions) -> Any:
    """An installed model's llama-server launched and verified (serving.launch_verified) with its plan,
    or with stock's placement where the install's check found the plan slower here (the same binary;
    operations.bench.stock_args). The caller holds the model's lock."""
    from moeplug.machine.rpc import check_hosts
    from moeplug.serving.launch import launch_verified

    plan = m.plan
    check_hosts(m.request.rpc if m.request else ())  # llama.cpp would abort on one: say which first
    # stock's placement still needs to see the plan's GPU (a software Vulkan device named by index)
    args, env = (stock_args(plan), dict(plan.device_env)) if m.placement == "stock" else (plan.server_args, m.server_env())
    return launch_verified(m.name, Path(m.path), build.binary("llama-server"), m.build_id, args, plan.ctx, env=env,
                           plan=plan, **serving.launch_options())


def warn_exposure(host: str, progress: ProgressFn) -> None:
    """The warning for a server that will listen beyond this machine, before it starts."""
    warning = exposure_warning(host)
    if warning:
        progress(Note(warning))


def installed_request(m: InstalledModel, choices: PlanChoices = PlanChoices(),
                      learned: dict[str, Any] | None = None) -> PlanRequest:
    """What a re-plan of an installed model asks: what was asked for it (InstalledModel.asked) with the
    choices given now (PlanChoices: None where not given; a budget not given is the stored one) and
    what a re-profile learned from its served requests (`learned`: prefill_weight, prompt_tokens and
    the traffic, `workload`). A budget given now asks for the planner's slots in it: the demo's fixed
    quarter of slots (slots_in_ram) goes, as `moeplug plan` (operations.actions.plan_model) drops it."""
    request = choices.over(m.asked(), choices.ctx or m.ctx)
    if choices.vram_budget is not None:
        request = replace(request, slots_in_ram=0)
    return request.given(**learned) if learned else request


def plan_installed(m: InstalledModel, choices: PlanChoices = PlanChoices(), profile: Profile | None = None,
                   learned: dict[str, Any] | None = None) -> Plan:
    """An installed model's plan made again (installed_request) from its profile (or `profile`, the one
    about to replace it). Nothing is stored (replan keeps it)."""
    path = Path(m.profile) if m.profile and (profile is not None or Path(m.profile).exists()) else None
    try:
        build = installed_build(m)
    except MoeplugError:
        build = None  # the build is gone: moeplug's own estimate
    return m.with_slots_in_ram(plan_for(inspect_model(m.path), installed_request(m, choices, learned), path, profile,
                                        build=build))


def replan(m: InstalledModel, choices: PlanChoices = PlanChoices(),
           learned: dict[str, Any] | None = None) -> InstalledModel:
    """Plan an installed model again (choices given, something learned from its traffic, or its profile
    changed: the stored ones otherwise) and keep that plan and what was asked as the model's own; the
    hooks follow."""
    plan = plan_installed(m, choices, learned=learned)
    request = replace(installed_request(m, choices, learned), vram_budget=plan.budget)
    record = replace(m, ctx=request.ctx, plan=plan, request=request)
    write_installed(record)
    refresh_hooks(list_installed())
    return record


def up_to_date(m: InstalledModel, progress: ProgressFn = silent) -> InstalledModel:
    """The installed model, its plan made again and kept where an older planner made it (plan.outdated),
    with its stored budget, context and choices, said in one line; as it is where its plan is current or
    the profile it was planned from is gone (a plan made now would lose the cache). The caller holds
    the model's lock (serving.model_lock)."""
    if not outdated(m.plan) or (m.profile is not None and not Path(m.profile).exists()):
        return m
    m = replan(m)
    progress(Note(f"{m.name}: its plan was made by an older moeplug planner; planned again with the same "
                  f"budget, context and choices ('moeplug plan {m.name}' shows it)"))
    return m


def replan_profile_users(profile: Path) -> list[InstalledModel]:
    """Re-plan the installed models whose profile is this file (made again, or replaced)."""
    return [replan(m) for m in list_installed() if m.profile and Path(m.profile).resolve() == profile.resolve()]
