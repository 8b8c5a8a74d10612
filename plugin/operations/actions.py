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
from moeplug.serving.installed import InstalledModel, list_installed, read_installed
from moeplug.operations.install import warn_exposure, installed_build, locate, plan_for, replan, replan_profile_users, up_to_date, require_moe
from moeplug.model.inspect import inspect_model
from moeplug.planner.record import Plan, outdated
from moeplug.planner.request import PlanRequest
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.serving.server import HOST
from moeplug.serving.launch import ServerRecord
from moeplug.planner.speculation import KeepInstalled, Speculation


def plan_model(model: str, *, ctx: int | None = None, vram_budget: int | list[int] | None = None,
               profile: Path | None = None, ctx_override: bool = False,
               spec: Speculation | KeepInstalled | None = KeepInstalled(), prefill_weight: float | None = None,
               threads: int | None = None, ubatch: int | None = None, prompt_tokens: int | None = None,
               progress: ProgressFn = silent) -> Plan:
    """Plan an installed model (by name) or any model reference, for a budget (None: free VRAM; a
    list: one per GPU) and a context (None: 4096, or the training context when smaller); profile
    None: the stored one. spec: speculative decoding (None: none; KeepInstalled: an installed
    model's own). prefill_weight: prompt tokens per generated token (None: an installed model's own,
    else the planner's default); threads: the server's CPU threads (None: as an installed model's
    user asked, else the planner's choice; 0: llama.cpp's default); ubatch: the server's physical batch
    (None: as an installed model's user asked, else the planner's choice, UBATCH_AUTO); prompt_tokens: the
    prompt length to plan prompt batches for (None: an installed model's own; 0: the profile's prompts)."""
    from moeplug.profile.format import model_fingerprint
    from moeplug.profile.runner import default_profile_path

    installed = {m.name: m for m in list_installed()}
    path = Path(installed[model].path) if model in installed else locate(model, download=False, progress=progress).path
    # an installed model's choices (its workload too, unless one is given), else the planner's defaults
    asked = installed[model].asked() if model in installed else PlanRequest(0)
    if isinstance(spec, KeepInstalled):
        spec = spec.resolve(asked.spec.to_json() if asked.spec else None)
    asked = asked.given(prefill_weight=prefill_weight, threads=threads, ubatch=ubatch, prompt_tokens=prompt_tokens)
    info = inspect_model(path)
    require_moe(info)
    profile = profile or default_profile_path(model_fingerprint(path))
    request = replace(asked, ctx=context_size(info, ctx, ctx_override), vram_budget=vram_budget, spec=spec,
                      slots_in_ram=0)
    return plan_for(info, request, profile if profile.exists() else None)


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


def serve(name: str, *, port: int | None = None, vram_budget: int | list[int] | None = None, ctx: int | None = None,
          ctx_override: bool = False, allow_fallback: bool = False, metrics: bool = True,
          record: bool | None = None,
          host: str = HOST, spec: Speculation | KeepInstalled | None = KeepInstalled(),
          prefill_weight: float | None = None, threads: int | None = None, ubatch: int | None = None,
          prompt_tokens: int | None = None, progress: ProgressFn = silent) -> Served:
    """Launch an installed model again (detached) with its build; re-planned when a budget or a
    context is given, or when an older planner made its plan (plan.outdated; not where its profile
    is gone), else with the plan it was installed with. Waits while another moeplug holds
    the model (an install, a re-profile), then reads the model as that one left it. metrics: count
    slot hits on /metrics (`moeplug status`, the dashboard). record: count the router's selections
    for `moeplug reprofile` (llama-server --moe-cache-record; None: where the build can). host: where
    it listens (127.0.0.1 unless the user gave another address; then a warning). spec: another
    speculative decoding to re-plan with and keep (None: none; KeepInstalled(): the installed one's).
    prefill_weight: prompt tokens per generated token to re-plan for and keep (None: the installed one's);
    threads likewise, the server's CPU threads (0: llama.cpp's default), ubatch, its physical batch
    (UBATCH_AUTO: the planner's choice), and prompt_tokens, the prompt length planned for (0: the profile's)."""
    from moeplug.serving.launch import launch_verified, model_lock

    warn_exposure(host, progress)
    read_installed(name)  # an unknown name fails now, not after a wait
    with model_lock(name, progress):
        m = read_installed(name)
        if (vram_budget is not None or ctx is not None or spec != KeepInstalled() or prefill_weight is not None
                or threads is not None or ubatch is not None or prompt_tokens is not None):
            if ctx is not None:
                ctx = context_size(inspect_model(m.path), ctx, ctx_override)
            # the new plan becomes the model's own; the hooks follow
            m = replan(m, ctx, vram_budget, spec, prefill_weight=prefill_weight, threads=threads, ubatch=ubatch,
                       prompt_tokens=prompt_tokens)
        else:
            m = up_to_date(m, progress)
        plan = m.plan
        served = launch_verified(m.name, Path(m.path), installed_build(m).binary("llama-server"), m.build_id,
                                 plan.server_args, plan.ctx, port=port, allow_fallback=allow_fallback,
                                 env=m.server_env(), metrics=metrics, plan=plan, record=record, host=host)
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
