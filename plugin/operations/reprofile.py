"""`moeplug reprofile`: learn the routing of the traffic a model gets, report drift, re-plan.

For each model (one name, or every installed one):

1. New counts. A model served recording (llama-server `--moe-cache-record`, which `moeplug serve`
   and `install` pass unless told `--no-record`): the counts the
   server has gathered since its start or the last re-profile that stored them, from
   `GET /moe-cache/profile`. A model not served: the profiler run again on the bundled prompt
   sets plus the model's `prompt_files` (its installed record; `--prompt-file` adds one). A model
   served with `--no-record`: its routing is not counted (and a second copy of a big model for the
   profiler is not what a scheduled job should load), so only its workload (step 4) is learned;
   where that has not moved either, it is an error that says to serve it recording (with `--all`,
   the model is skipped, with why: Skipped).
2. Decay. The stored profile, aged by the new counts' tokens, plus the new counts
   (moeplug.profile.format.merge_decayed): with T the prompt + generated tokens the new counts
   cover and H the half-life (`--half-life`, tokens), the stored counts and the weights of its
   sources are multiplied by 0.5 ** (T / H) and the new counts are added at weight 1. So a
   selection recorded H tokens before the newest one counts half, 2H a quarter.
3. Drift, per MoE layer: `predicted`, the hit rate the current plan's profile predicted for its
   slots (the planner's hit curve, moeplug.planner.allocate.hit_curves), against `measured`, the share of
   the new counts' selections the slots the server holds (the current profile's top experts,
   moeplug.planner.allocate.slot_order) would have served. `gain` is the new plan's predicted hit rate
   (the planner on the merged profile, moeplug.operations.install.plan_installed) minus the mean measured
   one: what re-planning is expected to add on traffic like the new one.
4. The workload. A served model's log (moeplug.serving.traffic) says how long the prompts it computed were
   and how many tokens it generated: from MIN_REQUESTS finished requests on, the prompt tokens per
   generated token and the prompt length that carries half the prompt tokens become the plan's
   `--prefill-weight` and `--prompt-tokens` (so its prompt batch, `--ubatch auto`, follows the
   prompts), where they are more than WORKLOAD_TOLERANCE away from the planned ones. `--workload
   auto` (the default) learns them unless the user set them (`install/plan/serve --prefill-weight
   or --prompt-tokens`: values other than the defaults, not learned before); `learn` learns over
   them; `keep` never does. The plan keeps the traffic it learned from (Plan.workload).
5. Below `--min-gain`, and no workload learned: nothing is written (exit 10); a served model's
   counters keep counting, so the next run sees more traffic. A learned workload alone re-plans
   from the stored profile, and restarts the server (as below) only where the plan's flags changed.
   Otherwise, under the model's lock (moeplug.serving.launch.model_lock;
   a concurrent `moeplug serve` or install waits): a served model's counters are read again and
   zeroed (`?reset=1`: every count is stored exactly once), merged with the stored profile as
   read under the lock, the old file copied to PROFILE.previous, the new one renamed over it
   (a reader sees the old file or the new one, never a mix), the models planned from it
   re-planned (moeplug.operations.install.replan_profile_users: records and proxy hooks follow).
6. `apply`: a served model is restarted with the new plan on the same port and flags, once no
   request has been in flight for `idle_s` seconds (`idle`), as soon as none is (`now`), or not
   at all (`never`: the next `moeplug serve` uses it). "In flight" is llama-server's /slots
   (`is_processing`, and the task id and token count moving between polls) and, with --metrics,
   /metrics' processing and deferred requests; the stop follows the last idle poll at once, so
   only a request that arrives in that instant (milliseconds) is refused rather than served.

`rollback(name)` swaps PROFILE and PROFILE.previous back and re-plans the same way.
Nothing here prints; every run appends one line to the run log (moeplug.operations.schedule).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moeplug.planner.allocate import hit_curves, served_share
from moeplug.core.errors import EXIT_ERROR, EXIT_NOTHING_TO_DO, EXIT_OK, MoeplugError
from moeplug.core.fsutil import atomic_path
from moeplug.serving.installed import InstalledModel, list_installed, read_installed, write_installed
from moeplug.operations.install import installed_build, plan_installed, replan, replan_profile_users, rerun_prompts
from moeplug.model.inspect import inspect_model
from moeplug.profile.format import (
    PHASE_DECODE,
    PHASE_PREFILL,
    Profile,
    ProfileError,
    merge_decayed,
    model_fingerprint,
    read_profile,
    write_profile,
)
from moeplug.profile.runner import count_prompts, default_profile_path
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.operations.schedule import append_run_log
from moeplug.serving.server import HOST
from moeplug.serving.launch import RECORD_FLAG, ServerRecord, find_record, launch_verified, model_lock, record_plan
from moeplug.serving.launch import stop as stop_server
from moeplug.serving.traffic import Traffic, learned_workload, read_traffic
from moeplug.serving import client

DEFAULT_HALF_LIFE = 100_000  # tokens
DEFAULT_MIN_GAIN = 0.01  # one point of hit rate
DEFAULT_IDLE_S = 60.0
DEFAULT_WAIT_S = 3600.0
APPLY_MODES = ("never", "idle", "now")
WORKLOAD_MODES = ("auto", "learn", "keep")
POLL_S = 0.25


@dataclass
class Options:
    half_life: int = DEFAULT_HALF_LIFE
    min_gain: float = DEFAULT_MIN_GAIN
    apply: str = "idle"
    idle_s: float = DEFAULT_IDLE_S
    wait_s: float = DEFAULT_WAIT_S  # the longest to wait for the idle moment before giving up the restart
    workload: str = "auto"  # WORKLOAD_MODES: learn the prefill weight and prompt length from the traffic


@dataclass
class LayerDrift:
    block: int
    slots: int
    n_expert: int
    predicted: float | None  # the stored profile's hit curve at these slots: what the plan expected
    measured: float | None  # the share of the new counts' selections these slots would have served

    @property
    def drift(self) -> float | None:
        return self.predicted - self.measured if self.predicted is not None and self.measured is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"block": self.block, "slots": self.slots, "n_expert": self.n_expert, "predicted": self.predicted,
                "measured": self.measured, "drift": self.drift}


@dataclass
class Reprofiled:
    """One model re-profiled (or not: `written` False), with what it found."""

    name: str
    source: str  # "live": the server's counts; "prompts": the profiler on the prompt sets; "log": the workload only
    tokens: dict[str, int]  # the new counts: {"prefill", "decode"}
    half_life: int
    old_weight: float  # what the stored counts were multiplied by
    layers: list[LayerDrift]
    plan_predicted: float | None  # the current plan's predicted hit rate
    measured: float | None  # the mean over layers of LayerDrift.measured
    new_predicted: float | None  # the new plan's predicted hit rate
    gain: float
    min_gain: float
    profile: str
    written: bool = False
    previous: str | None = None
    slots_before: list[int] = field(default_factory=list)
    slots_after: list[int] = field(default_factory=list)
    plan_changed: bool = False
    # "restarted", "not served", "never", "busy", "unchanged" (only the workload was stored, the server's flags
    # stay), "no" (nothing written)
    applied: str = "no"
    server: ServerRecord | None = None
    notes: list[str] = field(default_factory=list)
    traffic: Traffic | None = None  # the served model's requests, from its log
    # the prefill weight and prompt length learned from the traffic (None: not learned), and whether the plan
    # now holds them
    workload: dict[str, Any] | None = None
    workload_stored: bool = False

    @property
    def replanned(self) -> bool:
        return self.written or self.workload_stored

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "tokens": self.tokens, "half_life": self.half_life,
                "old_weight": self.old_weight, "layers": [x.to_json() for x in self.layers],
                "plan_predicted_hit_rate": self.plan_predicted, "measured_hit_rate": self.measured,
                "new_predicted_hit_rate": self.new_predicted, "gain": self.gain, "min_gain": self.min_gain,
                "written": self.written, "profile": self.profile, "previous": self.previous,
                "slots_before": self.slots_before, "slots_after": self.slots_after,
                "plan_changed": self.plan_changed, "applied": self.applied,
                "server": self.server.to_json() if self.server else None, "notes": self.notes,
                "traffic": self.traffic.to_json() if self.traffic else None, "workload": self.workload,
                "workload_stored": self.workload_stored}

    def log_line(self) -> str:
        what = "re-planned" if self.replanned else f"nothing to do (gain below {self.min_gain:+.3f})"
        learned = ""
        if self.workload_stored and self.workload:
            length = self.workload["prompt_tokens"]
            learned = (f", workload learned: prefill weight {self.workload['prefill_weight']:g}, prompt tokens "
                       f"{length if length else 'the profile prompts'}")
        return f"{self.name}: {what}, source {self.source}, gain {self.gain:+.3f}{learned}, applied {self.applied}"


@dataclass
class RolledBack:
    name: str
    profile: str
    previous: str
    slots_before: list[int]
    slots_after: list[int]
    plan_changed: bool
    applied: str
    server: ServerRecord | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rolled_back": True, "profile": self.profile, "previous": self.previous,
                "slots_before": self.slots_before, "slots_after": self.slots_after,
                "plan_changed": self.plan_changed, "applied": self.applied,
                "server": self.server.to_json() if self.server else None}

    def log_line(self) -> str:
        return f"{self.name}: rolled back to the previous profile, applied {self.applied}"


@dataclass
class Failed:
    name: str
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "error": self.error}

    def log_line(self) -> str:
        return f"{self.name}: error: {self.error}"


@dataclass
class Skipped:
    """A model `reprofile --all` left alone, and why (served without recording): not a failure."""

    name: str
    skipped: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "skipped": self.skipped}

    def log_line(self) -> str:
        return f"{self.name}: skipped: {self.skipped}"


class NotRecorded(MoeplugError):
    """A served model whose routing is not counted (served without RECORD_FLAG), with nothing else to learn."""


@dataclass
class Run:
    """Every model of one `moeplug reprofile`: 0 when one was re-planned or rolled back (and none
    failed), 10 when none needed it, 1 when one failed (a Skipped model is neither)."""

    results: list[Any]

    @property
    def exit_code(self) -> int:
        if any(isinstance(r, Failed) for r in self.results):
            return EXIT_ERROR
        if any(isinstance(r, RolledBack) or getattr(r, "replanned", False) for r in self.results):
            return EXIT_OK
        return EXIT_NOTHING_TO_DO

    def to_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "models": [r.to_json() for r in self.results]}


# ---------------------------------------------------------------------------------------------
# the profile file and the one kept before it


def previous_path(profile: Path) -> Path:
    """Where the profile a re-profile replaced is kept (not *.gguf: nothing takes it for a profile)."""
    return profile.with_name(profile.name + ".previous")


def store_profile(profile: Profile, dest: Path) -> Path | None:
    """Replace `dest` with `profile`, keeping the file it replaces as previous_path(dest). Each
    step is a rename of a complete file: killed at any point, `dest` is the old profile or the new
    one. Returns the kept previous file (None: there was none)."""
    prev = previous_path(dest)
    kept = None
    if dest.exists():
        with atomic_path(prev) as tmp:
            shutil.copyfile(dest, tmp)
        kept = prev
    write_profile(profile, dest)
    return kept


def swap_previous(dest: Path) -> Path:
    """Put the previous profile back as `dest` and keep the replaced one as the previous."""
    prev = previous_path(dest)
    if not prev.exists():
        raise MoeplugError(f"no previous profile to restore: {prev} does not exist (a re-profile that replaced "
                           f"the profile keeps one)")
    read_profile(prev)  # a damaged file is refused before anything moves
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(dest, tmp)
        os.replace(prev, dest)  # killed after this: dest is the restored profile, the replaced one lost
        os.replace(tmp, prev)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return prev


# ---------------------------------------------------------------------------------------------
# new counts


def _require_recording(record: ServerRecord) -> None:
    if RECORD_FLAG not in record.args:
        raise NotRecorded(f"'{record.name}' is served without {RECORD_FLAG} (--no-record), so its routing is not "
                          f"counted: 'moeplug stop {record.name}' and 'moeplug serve {record.name}' serve it "
                          f"recording (the default), or stop it to re-profile with the prompts")


def fetch_live_profile(record: ServerRecord, reset: bool = False, timeout: float = 60) -> Profile:
    """The routing counts a server run with --moe-cache-record gathered (reset: and zero them)."""
    _require_recording(record)
    try:
        content = client.moe_profile(f"http://{HOST}:{record.port}", reset, timeout)
    except MoeplugError as exc:
        raise MoeplugError(f"'{record.name}': {exc}") from None
    with tempfile.TemporaryDirectory(prefix="moeplug-live-") as tmp:
        path = Path(tmp) / "live.gguf"
        path.write_bytes(content)
        return read_profile(path)


def _new_counts(m: InstalledModel, served: ServerRecord | None, progress: ProgressFn) -> tuple[str, Profile]:
    if served is not None:
        _require_recording(served)
        progress(Note(f"{m.name}: reading the routing counts of the server at {served.url}"))
        return "live", fetch_live_profile(served)
    with tempfile.TemporaryDirectory(prefix="moeplug-reprofile-") as tmp:
        return "prompts", rerun_prompts(m, Path(tmp) / "new.gguf", progress)


def _served(name: str) -> ServerRecord | None:
    record = find_record(name)
    return record if record is not None and record.alive() else None


# ---------------------------------------------------------------------------------------------
# drift


def _drift(m: InstalledModel, old: Profile | None, new: Profile) -> list[LayerDrift]:
    info = inspect_model(m.path)
    n_layers, n_expert = len(info.layers), info.n_expert
    planned = m.plan.slots_per_layer
    slots = list(planned) if isinstance(planned, list) else [int(planned)] * n_layers  # an older record: one count
    traffic = (new.counts_prefill + new.counts_decode)[:n_layers]
    if old is None:
        return [LayerDrift(layer.block, n, n_expert, None, None) for layer, n in zip(info.layers, slots)]
    curves = hit_curves(old, n_layers, n_expert)
    measured = served_share(old, slots, traffic)
    return [LayerDrift(layer.block, n, n_expert, float(curves[i][min(n, n_expert)]), measured[i])
            for i, (layer, n) in enumerate(zip(info.layers, slots))]


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


# ---------------------------------------------------------------------------------------------
# applying a plan to a served model


def _activity(port: int) -> tuple[bool, tuple[Any, ...]] | None:
    """(a request in flight?, marks that move with any request) from /slots and /metrics; None
    when neither tells (a server run with --no-slots and without --metrics)."""
    from moeplug.serving.monitor import parse_server_metrics

    url = f"http://{HOST}:{port}"
    busy, marks, told = False, [], False
    try:
        found = client.slots(url)
        for s in found or []:
            busy |= bool(s.get("is_processing"))
            nxt = (s.get("next_token") or [{}])[0]
            marks.append((s.get("id"), s.get("id_task"), nxt.get("n_decoded"), s.get("n_prompt_tokens_processed")))
        told = found is not None
        page = client.metrics_page(url, timeout=5)
        m = parse_server_metrics(page) if page is not None else None
        if m is not None:
            busy |= m.requests_processing + m.requests_deferred > 0
            marks.append((m.prompt_tokens, m.decode_tokens))
            told = True
    except (ValueError, TypeError, AttributeError, IndexError):
        return None
    return (busy, tuple(marks)) if told else None


def wait_for_idle(record: ServerRecord, idle_s: float, wait_s: float, progress: ProgressFn = silent,
                  poll_s: float = POLL_S) -> bool:
    """True once no request has been in flight on the server for idle_s seconds (0: as soon as
    none is), False when that did not happen within wait_s seconds."""
    deadline = time.monotonic() + wait_s
    quiet_since: float | None = None
    last: tuple[Any, ...] | None = None
    said = False
    while True:
        seen = _activity(record.port)
        if seen is None:
            raise MoeplugError(f"cannot tell whether '{record.name}' is serving a request (/slots and /metrics do "
                               f"not answer): not restarting it")
        busy, marks = seen
        now = time.monotonic()
        if busy or (last is not None and marks != last):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        last = marks
        if quiet_since is not None and now - quiet_since >= idle_s:
            return True
        if now >= deadline:
            return False
        if not said:
            progress(Note(f"{record.name}: waiting for {idle_s:g} s without a request before restarting it"))
            said = True
        time.sleep(min(poll_s, max(0.01, idle_s / 4)))


def _apply(m: InstalledModel, served: ServerRecord | None, opts: Options,
           progress: ProgressFn) -> tuple[str, ServerRecord | None]:
    """Restart a served model with its (new) plan per opts.apply; call under the model's lock."""
    if served is None or not served.alive():
        return "not served", None
    if opts.apply == "never":
        return "never", None
    try:
        idle = wait_for_idle(served, opts.idle_s if opts.apply == "idle" else 0.0, opts.wait_s, progress)
    except MoeplugError as exc:  # the profile and plan are stored: report, do not fail the run
        progress(Note(f"{m.name}: {exc}"))
        return f"not restarted: {exc}", None
    if not idle:
        progress(Note(f"{m.name}: still busy after {opts.wait_s:g} s: not restarted (the next serve uses the new plan)"))
        return "busy", None
    progress(Note(f"{m.name}: restarting it with the new plan on port {served.port}"))
    stop_server(m.name)
    plan = m.plan
    engaged = bool((served.cache or {}).get("engaged", True))
    record = launch_verified(m.name, Path(m.path), installed_build(m).binary("llama-server"), m.build_id,
                             plan.server_args, plan.ctx, port=served.port, allow_fallback=not engaged,
                             env=m.server_env(), metrics="--metrics" in served.args, plan=plan,
                             record=RECORD_FLAG in served.args)
    return "restarted", record


# ---------------------------------------------------------------------------------------------
# the actions


def add_prompt_files(name: str, files: list[str], progress: ProgressFn = silent) -> InstalledModel:
    """Add prompt files (.txt, prompts separated by '---' lines) to an installed model's
    `prompt_files`, which a re-profile of the model when it is not served runs."""
    paths = []
    for f in files:
        path = Path(f).resolve()
        if not (path.is_file() and path.suffix == ".txt" and count_prompts(path)):
            raise MoeplugError(f"{f}: not a prompt file (a .txt file of prompts separated by '---' lines)")
        paths.append(str(path))
    with model_lock(name, progress):
        m = read_installed(name)
        m = replace(m, prompt_files=[*m.prompt_files, *(p for p in paths if p not in m.prompt_files)])
        write_installed(m)
    return m


def _learn(m: InstalledModel, served: ServerRecord | None, opts: Options, result: Reprofiled) -> dict[str, Any]:
    """What plan_installed learns (its `learned`) from the workload a served model's traffic shows (module docstring,
    step 4), or {} where none is learned; what it read and why it kept the plan's go to `result`."""
    if served is None or opts.workload == "keep":
        return {}
    result.traffic = traffic = read_traffic(served.log, served.traffic_from)
    if m.plan.workload_source == "asked" and opts.workload == "auto":
        result.notes.append(f"the prefill weight ({m.plan.prefill_weight:g}) and prompt length "
                            f"({m.plan.prompt_tokens or 'the profile prompts'}) were set by hand: kept "
                            f"(--workload learn learns them from the traffic)")
        return {}
    learned = learned_workload(traffic, m.plan.prefill_weight, m.plan.prompt_tokens)
    if learned is None or traffic is None:
        return {}
    result.workload = {"prefill_weight": learned[0], "prompt_tokens": learned[1]}
    return {"prefill_weight": learned[0], "prompt_tokens": learned[1] or 0, "workload": traffic.to_json()}


def _keep_workload(m: InstalledModel, workload: dict[str, Any], result: Reprofiled,
                   progress: ProgressFn) -> InstalledModel:
    """The model with the learned workload in its stored plan (every re-plan after starts from it);
    under the model's lock."""
    learned = dict(prefill_weight=workload["prefill_weight"], prompt_tokens=workload["prompt_tokens"] or None,
                   workload=workload["workload"])
    m = replace(m, plan=replace(m.plan, **learned), request=replace(m.asked(), **learned))
    write_installed(m)
    result.workload_stored = True
    if result.traffic is not None:
        progress(Note(f"{m.name}: planning for the traffic served: {result.traffic.summary()}"))
    return m


def _finish(name: str, before: Any, restart: bool, opts: Options, result: Reprofiled, progress: ProgressFn) -> None:
    """After a re-plan under the model's lock: what changed, and the server restarted per opts.apply
    where `restart` or the plan's flags changed (else its record keeps the new plan)."""
    after = read_installed(name)
    result.slots_after = list(after.plan.slots_per_layer)
    result.plan_changed = after.plan.to_json() != before.to_json()
    served = _served(name)
    if not restart and (after.plan.server_args, after.plan.server_env()) == (before.server_args, before.server_env()):
        result.applied = "unchanged"  # the server runs these flags already: no restart
        if served is not None:
            record_plan(name, after.plan)
    else:
        result.applied, result.server = _apply(after, served, opts, progress)


def _workload_only(m: InstalledModel, served: ServerRecord, opts: Options, progress: ProgressFn) -> Reprofiled:
    """A model served without --record: its routing is not counted, but its log still tells the
    workload; re-plan for it where it moved, else the error that routing is not counted."""
    result = Reprofiled(name=m.name, source="log", tokens={"prefill": 0, "decode": 0}, half_life=opts.half_life,
                        old_weight=1.0, layers=[], plan_predicted=m.plan.predicted_hit_rate, measured=None,
                        new_predicted=None, gain=0.0, min_gain=opts.min_gain, profile=m.profile or "",
                        slots_before=list(m.plan.slots_per_layer))
    workload = _learn(m, served, opts, result)
    if not workload:
        _require_recording(served)  # nothing to learn either: say what would
    result.notes.append(f"its routing is not counted (served without {RECORD_FLAG}): the workload alone; "
                        f"serving it again without --no-record counts the routing as well")
    with model_lock(m.name, progress):
        m = read_installed(m.name)
        before = m.plan
        replan(_keep_workload(m, workload, result, progress))
        _finish(m.name, before, False, opts, result, progress)
    return result


def reprofile_model(name: str, opts: Options, progress: ProgressFn = silent) -> Reprofiled:
    """Re-profile one installed model (module docstring: the steps)."""
    m = read_installed(name)
    served = _served(name)
    if served is not None and RECORD_FLAG not in served.args:
        return _workload_only(m, served, opts, progress)
    source, new = _new_counts(m, served, progress)
    fingerprint = model_fingerprint(m.path)
    new.check_model(fingerprint)
    dest = Path(m.profile) if m.profile else default_profile_path(fingerprint)
    old = read_profile(dest) if dest.exists() else None
    merged = merge_decayed(old, new, opts.half_life) if old else new
    layers = _drift(m, old, new)
    measured = _mean([x.measured for x in layers])
    tokens = {"prefill": new.tokens(PHASE_PREFILL), "decode": new.tokens(PHASE_DECODE)}
    result = Reprofiled(name=name, source=source, tokens=tokens, half_life=opts.half_life,
                        old_weight=0.5 ** ((tokens["prefill"] + tokens["decode"]) / opts.half_life) if old else 0.0,
                        layers=layers, plan_predicted=m.plan.predicted_hit_rate, measured=measured,
                        new_predicted=None, gain=0.0, min_gain=opts.min_gain,
                        profile=str(dest), slots_before=[x.slots for x in layers])
    workload = _learn(m, served, opts, result)
    preview = plan_installed(replace(m, profile=str(dest)), profile=merged, learned=workload or None)
    result.new_predicted = preview.predicted_hit_rate
    result.gain = (preview.predicted_hit_rate or 0.0) - (measured or 0.0)
    if not tokens["prefill"] + tokens["decode"]:
        result.notes.append("no new traffic counted since the last re-profile")
        return result
    store = result.gain >= opts.min_gain
    if not store and not workload:
        return result  # neither the new counts nor the traffic's workload move the plan enough

    with model_lock(name, progress):
        m = read_installed(name)  # as a concurrent moeplug may have left it
        before = m.plan
        if workload:
            m = _keep_workload(m, workload, result, progress)
        if store:
            if served is not None:  # the counts again, zeroed as they are read: each one is stored once
                new = fetch_live_profile(served, reset=True)
                new.check_model(fingerprint)
            old = read_profile(dest) if dest.exists() else None  # a concurrent re-profile may have stored one
            merged = merge_decayed(old, new, opts.half_life) if old else new
            kept = store_profile(merged, dest)
            progress(Note(f"{name}: profile replaced: {dest}" + (f" (previous kept: {kept})" if kept else "")))
            if m.profile != str(dest):
                write_installed(replace(m, profile=str(dest)))
            replan_profile_users(dest)
            result.written, result.previous = True, str(kept) if kept else None
        else:
            replan(m)
        _finish(name, before, store, opts, result, progress)
    return result


def rollback(name: str, opts: Options, progress: ProgressFn = silent) -> RolledBack:
    """Restore the profile a re-profile replaced (the replaced one becomes the previous), re-plan,
    and apply as a re-profile does."""
    with model_lock(name, progress):
        m = read_installed(name)
        if not m.profile:
            raise MoeplugError(f"'{name}' has no profile to roll back")
        dest = Path(m.profile)
        prev = swap_previous(dest)
        progress(Note(f"{name}: restored the previous profile {dest} (the replaced one is now {prev})"))
        replan_profile_users(dest)
        after = read_installed(name)
        applied, server = _apply(after, _served(name), opts, progress)
    return RolledBack(name, str(dest), str(prev), list(m.plan.slots_per_layer), list(after.plan.slots_per_layer),
                      after.plan.to_json() != m.plan.to_json(), applied, server)


def not_reprofiled() -> list[dict[str, str]]:
    """The installed models a `reprofile --all` run now would skip, and why: those served without
    recording (--no-record), whose routing is not counted (Skipped)."""
    out = []
    for m in list_installed():
        record = find_record(m.name)
        if record is not None and record.alive() and RECORD_FLAG not in record.args:
            out.append({"name": m.name, "why": f"served without {RECORD_FLAG} (--no-record): its routing is not "
                                               f"counted; 'moeplug stop {m.name}' and 'moeplug serve {m.name}' "
                                               f"serve it recording (the default)"})
    return out

def reprofile(names: list[str] | None, opts: Options, roll_back: bool = False,
              progress: ProgressFn = silent) -> Run:
    """Re-profile (or roll back) the named models, or every installed one (names None); a model
    that fails is reported with its error and the others go on. One line per run goes to the run
    log (moeplug.operations.schedule.run_log_path). With every installed model (names None), one served without
    recording and nothing else to learn is Skipped, with why, not a failure of the run."""
    if opts.apply not in APPLY_MODES:
        raise MoeplugError(f"--apply {opts.apply}: expected one of {', '.join(APPLY_MODES)}")
    if opts.workload not in WORKLOAD_MODES:
        raise MoeplugError(f"--workload {opts.workload}: expected one of {', '.join(WORKLOAD_MODES)}")
    every = names is None
    if names is None:
        names = [m.name for m in list_installed()]
    else:
        for n in names:
            read_installed(n)  # an unknown name is an error before anything runs
    results: list[Any] = []
    for n in names:
        try:
            results.append(rollback(n, opts, progress) if roll_back else reprofile_model(n, opts, progress))
        except NotRecorded as exc:
            if not every:
                append_run_log(f"exit {EXIT_ERROR}: {n}: error: {exc}")
                raise
            results.append(Skipped(n, str(exc)))
        except (MoeplugError, ProfileError, OSError) as exc:
            if len(names) == 1:
                append_run_log(f"exit {EXIT_ERROR}: {n}: error: {exc}")
                raise
            results.append(Failed(n, str(exc)))
    run = Run(results)
    append_run_log(f"exit {run.exit_code}: " + ("; ".join(r.log_line() for r in results) or "no installed model"))
    return run
