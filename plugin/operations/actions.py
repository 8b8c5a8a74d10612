"""The actions behind the CLI, the dashboard, the hooks and the scheduler: plan, serve, stop and
profile a model, each taking a progress callback and returning a typed result (with `to_json()`).

`moeplug.operations.install.install` is the fifth; `moeplug.commands.main` only parses arguments and renders what
these return. Nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moeplug.core.errors import EXIT_ERROR, EXIT_OK, MoeplugError
from moeplug.planner.estimates import context_size
from moeplug.serving.installed import InstalledModel, list_installed, read_installed, write_installed
from moeplug.operations.install import install as install_model
from moeplug.operations.install import Installed, warn_exposure, installed_build, launch_installed, locate, plan_for, replan, replan_profile_users, up_to_date, require_moe
from moeplug.model.inspect import inspect_model
from moeplug.planner.record import Plan, outdated
from moeplug.planner.request import PlanChoices, PlanRequest
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.serving.launch import ServeOptions, ServerRecord


def plan_model(model: str, choices: PlanChoices = PlanChoices(), profile: Path | None = None,
               progress: ProgressFn = silent) -> Plan:
    """Plan an installed model (by name) or any model reference with the choices given (PlanChoices:
    None where not given, then an installed model's own, else the planner's defaults; a budget not
    given is each GPU's free VRAM); profile None: the stored one. Nothing is stored."""
    from moeplug.profile.format import model_fingerprint
    from moeplug.profile.runner import default_profile_path

    installed = {m.name: m for m in list_installed()}
    path = Path(installed[model].path) if model in installed else locate(model, download=False, progress=progress).path
    info = inspect_model(path)
    require_moe(info)
    asked = installed[model].asked() if model in installed else PlanRequest(0)
    request = replace(choices.over(asked, context_size(info, choices.ctx, choices.ctx_override), budget_kept=False),
                      slots_in_ram=0)
    profile = profile or default_profile_path(model_fingerprint(path))
    build = installed_build(installed[model]) if model in installed else None
    plan = plan_for(info, request, profile if profile.exists() else None, build=build, progress=progress)
    return installed[model].with_slots_in_ram(plan) if model in installed else plan


def install(text: str, choices: PlanChoices = PlanChoices(), serving: ServeOptions | None = ServeOptions(), *,
            backend: str | None = None, jobs: int = 0, profile_tokens: int | None = None,
            prompt_sets: list[str] | None = None, check: bool | None = None,
            check_min: float | None = None, progress: ProgressFn = silent) -> Installed:
    """`moeplug install`: the model installed (operations.install.install), checked against stock
    --fit here (operations.check; check None: where there is a GPU; stock's placement kept where the
    best plan decodes below check_min of stock's, None: CHECK_BAR), and with serving options (None: not)
    served."""
    from moeplug.machine.gpu import gpus
    from moeplug.serving.launch import model_lock

    if serving is not None:
        warn_exposure(serving.host, progress)
    done, build = install_model(text, choices, backend=backend, jobs=jobs, profile_tokens=profile_tokens,
                                prompt_sets=prompt_sets, progress=progress)
    if check if check is not None else bool(gpus()):
        m = checked(done.name, check_min, progress)
        done.verdict, done.plan = m.verdict, m.plan
    if serving is not None:
        with model_lock(done.name, progress):
            done.server = launch_installed(read_installed(done.name), build, serving)
    return done


def checked(name: str, bar: float | None = None, progress: ProgressFn = silent) -> InstalledModel:
    """The installed model's placements run side by side here and the fastest kept with it (operations.check;
    bar None: CHECK_BAR): its verdict, and where the plan made with the fitted figures won, that plan and
    those figures for its later re-plans; the hooks follow what is served."""
    from moeplug.hooks import refresh_hooks
    from moeplug.operations.check import CHECK_BAR, check_plan, costs_kept
    from moeplug.serving.launch import find_record, model_lock

    served = find_record(name)
    if served is not None and served.alive():
        raise MoeplugError(f"'{name}' is being served (pid {served.pid}): 'moeplug stop {name}' first, so that the "
                           f"check has the GPU to itself")
    with model_lock(name, progress):
        m = read_installed(name)
    verdict, plan = check_plan(m, CHECK_BAR if bar is None else bar, progress)
    with model_lock(name, progress):
        m = read_installed(name)
        request = replace(m.asked(), costs=costs_kept(verdict))
        m = replace(m, plan=plan, request=request, verdict=verdict)
        write_installed(m)
    refresh_hooks(list_installed(), progress)
    progress(Note(f"{name}: {verdict.why()}"))
    return m


@dataclass
class Served:
    name: str
    server: ServerRecord

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "server": self.server.to_json()}


def installed_up_to_date(progress: ProgressFn = silent) -> list[InstalledModel]:
    """Every installed model, those an older planner planned made again first (up_to_date): what a
    hook writes into a proxy's configuration, which starts the servers without `moeplug serve`."""
    from moeplug.serving.launch import model_lock

    models = []
    for m in list_installed():
        if outdated(m.plan):
            with model_lock(m.name, progress):
                m = up_to_date(read_installed(m.name), progress)
        models.append(m)
    return models


def serve(name: str, choices: PlanChoices = PlanChoices(), serving: ServeOptions = ServeOptions(),
          check: bool | None = None, progress: ProgressFn = silent) -> Served:
    """Launch an installed model again (detached) with its build: re-planned where choices are given
    (the new plan and choices become the model's own; the hooks follow) or where an older planner made
    its plan (plan.outdated; not where its profile is gone), else with the plan it was installed with.
    A re-plan is checked before it is served (checked; check None: where there is a GPU, as install
    does), so that what is served is what ran fastest here. Waits while another moeplug holds the model
    (an install, a re-profile), then reads the model as that one left it."""
    from moeplug.machine.gpu import gpus
    from moeplug.serving.launch import model_lock

    warn_exposure(serving.host, progress)
    read_installed(name)  # an unknown name fails now, not after a wait
    with model_lock(name, progress):
        m = read_installed(name)
        if choices.changes_plan:
            if choices.ctx is not None:
                choices = replace(choices, ctx=context_size(inspect_model(m.path), choices.ctx, choices.ctx_override))
            replanned = replan(m, choices)
        else:
            replanned = up_to_date(m, progress)
    if replanned is not m and (check if check is not None else bool(gpus())):
        checked(name, replanned.verdict.bar if replanned.verdict else None, progress)
    with model_lock(name, progress):
        m = read_installed(name)
        served = launch_installed(m, installed_build(m), serving)
    return Served(m.name, served)


@dataclass
class Stopped:
    names: list[str]  # asked for
    stopped: list[str]  # were running, now stopped
    all_served: bool = False

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.all_served or self.stopped else EXIT_ERROR

    def to_json(self) -> dict[str, Any]:
        return {"stopped": self.stopped}


def stop(name: str | None = None, all_served: bool = False, progress: ProgressFn = silent) -> Stopped:
    """Stop one served model, or every one (all_served=True); each may take a few seconds."""
    from moeplug.serving.launch import find_record, read_records
    from moeplug.serving.launch import stop as stop_served

    names = [r.name for r in read_records()] if all_served else [name] if name else []
    if not all_served and not names:
        raise MoeplugError("name a served model, or pass --all")
    stopped = []
    for n in names:
        record = find_record(n)
        if record is not None and record.alive():  # a note only where a stop takes time: "was not running" alone
            progress(Note(f"stopping {n}"))
        if stop_served(n):
            stopped.append(n)
    return Stopped(names, stopped, all_served)


@dataclass
class Profiled:
    path: Path
    analysis: Any  # moeplug.profile.Analysis

    def to_json(self) -> dict[str, Any]:
        return {"profile": str(self.path), **self.analysis.to_json()}


def profile(model: Path, *, prompt_sets: list[str], out: Path | None = None, backend: str | None = None,
            n_predict: int = 512, ctx: int | None = None, ctx_override: bool = False, threads: int | None = None,
            seed: int = 42, temp: float = 0.0, ngl: int | None = None, ignore_eos: bool = False,
            mtp: bool = True, slots: list[int] | None = None, repick_every: int = 64,
            progress: ProgressFn = silent) -> Profiled:
    """Run the router profiler over prompt sets, merge, store (out None: by the model's
    fingerprint), and analyse the hit rate of `slots` slots per layer."""
    from moeplug.native.build import build, resolve_options
    from moeplug.profile import analyze
    from moeplug.profile.runner import ProfileRun, resolve_prompt_set, run_profile

    info = inspect_model(model)  # a clear error now for a missing, damaged or dense model
    ctx = context_size(info, ctx, ctx_override)
    for name in prompt_sets:
        resolve_prompt_set(name)  # an unknown set fails before the build
    result = build(resolve_options(backend, stock=False, jobs=0, cuda_arch=None), progress=progress)
    tool = result.binary("llama-moe-profile")
    if not tool.exists():
        raise MoeplugError(f"build {result.build_id} has no llama-moe-profile; rebuild with 'moeplug native build'")
    extra = ["-ngl", str(ngl)] if ngl is not None else []
    if not mtp:
        extra.append("--no-mtp")
    run = ProfileRun(tool=tool, model=model, n_predict=n_predict, ctx=ctx, threads=threads, seed=seed, temp=temp,
                     ignore_eos=ignore_eos, extra_args=tuple(extra))
    dest, merged = run_profile(run, prompt_sets, out, progress)
    replan_profile_users(dest)  # installed models planned from this profile, and their hooks, follow it
    return Profiled(dest, analyze(merged, slots, repick_every))


@dataclass
class ProfiledFromTrace(Profiled):
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "source": self.source}


def profile_from_trace(trace: Path | str, model: Path | str, prompts: str | None = None, out: Path | None = None,
                       slots: list[int] | None = None, repick_every: int = 64) -> ProfiledFromTrace:
    """The profile of `model` whose counts are a recorded trace's (an npz or a route replay file;
    prompts: a range A:B of its prompts), stored (out None: by the model's fingerprint) and analysed."""
    from moeplug.profile import analyze, write_profile
    from moeplug.profile.from_trace import profile_from_trace_file
    from moeplug.profile.runner import default_profile_path

    made = profile_from_trace_file(trace, model, prompts)
    dest = out or default_profile_path(made.fingerprint)
    write_profile(made, dest)
    replan_profile_users(dest)
    return ProfiledFromTrace(dest, analyze(made, slots, repick_every), made.sources[0].label)


@dataclass
class Calibrated:
    """What `moeplug calibrate` did: the calibration, its file, and whether the file was reused."""

    calibration: Any  # operations.calibrate.Calibration
    path: Path
    reused: bool

    def to_json(self) -> dict[str, Any]:
        return {**self.calibration.to_json(), "path": str(self.path), "reused": self.reused}


def largest_installed() -> str | None:
    """The name of the largest installed model whose file is here, the demo aside (None: none)."""
    from moeplug.model.demo import demo_model_path

    sizes = {m.name: Path(m.path).stat().st_size for m in list_installed()
             if Path(m.path).is_file() and Path(m.path).name != demo_model_path().name}
    return max(sizes, key=lambda n: sizes[n]) if sizes else None


def model_and_build(text: str | None, progress: ProgressFn = silent) -> tuple[Path | None, Any]:
    """The model to measure with and its build: an installed model's own build (None: the largest installed,
    the demo aside), or for a model reference or path (None with nothing installed: the demo model) the
    current patched build (made where missing)."""
    from moeplug.native.build import build, resolve_options
    from moeplug.serving.installed import installed_dir

    if text is None:
        text = largest_installed()
        if text is not None:
            progress(Note(f"measuring with {text}, the largest model installed ('moeplug calibrate MODEL' for another)"))
    if text and (installed_dir() / f"{text}.json").exists():
        m = read_installed(text)
        return Path(m.path), installed_build(m)
    path: Path | None = None
    if text:
        path = locate(text, download=False, progress=progress).path
    return path, build(resolve_options(None, stock=False, jobs=0, cuda_arch=None), progress=progress)


def calibrate_model(text: str | None, threads: int | None = None, force: bool = False,
                    progress: ProgressFn = silent, rpc: tuple[str, ...] = ()) -> Calibrated:
    """`moeplug calibrate [MODEL] [--rpc HOST:PORT,...]`: this fingerprint's file where there is one (and
    it was measured at the threads asked, where asked, and to the first rpc-server asked, where asked; and,
    measuring with a real model, not on the demo model or by an older moeplug: calibrate.remeasure_reason),
    else a new measurement written to it; force: measure again."""
    from moeplug.machine.rpc import parse_rpc, reachable
    from moeplug.model.demo import demo_model_path
    from moeplug.operations.calibrate import (calibrate, calibration_path, machine_fingerprint, remeasure_reason,
                                              stored_calibration, write_calibration)

    hosts = parse_rpc(",".join(rpc)) if rpc else ()
    for host in hosts:  # before a build or the demo model is made
        reachable(host)
    model, build = model_and_build(text, progress)
    path = calibration_path(machine_fingerprint(build.build_id)[0])
    if not force:
        stored = stored_calibration(build)
        stale = remeasure_reason(stored) if model is not None and model.name != demo_model_path().name else None
        if (stored is not None and stale is None and (threads is None or stored.threads == threads)
                and (not hosts or stored.rpc == [hosts[0].endpoint])):
            progress(Note(f"this machine is calibrated: {path} ('--force' measures again)"))
            return Calibrated(stored, path, reused=True)
        if stored is not None and stale is not None:
            progress(Note(f"measuring again with {model.name}: {stale}"))
    cal = calibrate(build, model, threads, progress, rpc=hosts)
    return Calibrated(cal, write_calibration(cal, path), reused=False)
