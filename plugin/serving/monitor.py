"""Snapshots of the models moeplug serves: one collector for `moeplug status`, the dashboard and
the re-profiler.

A snapshot reads, for every server record (moeplug.serving.launch): whether the process lives and
/health answers ok, its uptime, the `moe-cache:` line its log held at launch, the requests its
log has finished since (moeplug.serving.traffic, read incrementally), and, for a server
run with `--metrics`, llama-server's /metrics page: the expert cache's slot-hit counters (total
and per layer, moeplug.serving.metrics) and the server's own token and request counters. /slots gives
the context in use. Per MoE layer it sets the slots of the plan the server runs beside the hit
rate the profile predicts for them and the one measured. GPUs come from moeplug.machine.gpu (NVML), an empty
list without an NVIDIA GPU. Per device of a plan split over several (GPUs of this machine, remote
devices through llama.cpp's RPC backend) what it holds. Where a server is down, waits on a remote
device, or lost one, moeplug.serving.liveness says why in one line. Nothing here prints or imports
a UI toolkit; every call that can block (HTTP, NVML, reading a profile, a connection to a remote
host) is bounded by a timeout and belongs off a UI thread.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moeplug.machine.gpu import GpuInfo, gpus, process_vram_bytes
from moeplug.planner.record import Plan
from moeplug.serving.installed import InstalledModel, list_installed
from moeplug.serving.metrics import CacheCounters, fetch_metrics_page, parse_cache_counters
from moeplug.serving.launch import ServerRecord, read_records
from moeplug.serving import client, liveness
from moeplug.serving.server import health
from moeplug.serving.traffic import LogTraffic, Traffic

_SERVER_SAMPLE_RE = re.compile(r"^llamacpp:(\w+) ([-+\d.eE]+|nan|inf)$")
HTTP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ServerMetrics:
    """llama-server's own counters from /metrics (totals since it started)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    requests_processing: int = 0
    requests_deferred: int = 0

    @property
    def prompt_tokens_per_s(self) -> float | None:
        """Prefill throughput over every prompt it processed."""
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    def since(self, before: ServerMetrics, last: ServerMetrics | None = None) -> ServerMetrics:
        """The counters' growth since an earlier reading: the throughput of the requests in
        between. A phase (prefill, decode) that did not run in between keeps `last`'s figures,
        the growth of an earlier interval, so that an idle server shows its last requests."""
        prompt = (self.prompt_tokens - before.prompt_tokens, self.prompt_seconds - before.prompt_seconds)
        decode = (self.decode_tokens - before.decode_tokens, self.decode_seconds - before.decode_seconds)
        if prompt[1] <= 0:
            prompt = (last.prompt_tokens, last.prompt_seconds) if last else (0, 0.0)
        if decode[1] <= 0:
            decode = (last.decode_tokens, last.decode_seconds) if last else (0, 0.0)
        return ServerMetrics(*prompt, *decode, self.requests_processing, self.requests_deferred)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"prompt_tokens_per_s": self.prompt_tokens_per_s,
                               "decode_tokens_per_s": self.decode_tokens_per_s}


_SERVER_FIELDS = {"prompt_tokens_total": "prompt_tokens", "prompt_seconds_total": "prompt_seconds",
                  "tokens_predicted_total": "decode_tokens", "tokens_predicted_seconds_total": "decode_seconds",
                  "requests_processing": "requests_processing", "requests_deferred": "requests_deferred"}


def parse_server_metrics(text: str) -> ServerMetrics | None:
    """llama-server's counters of a Prometheus text page, or None when it has none."""
    values: dict[str, Any] = {}
    for line in text.splitlines():
        m = _SERVER_SAMPLE_RE.match(line.strip())
        if m and m[1] in _SERVER_FIELDS:
            name = _SERVER_FIELDS[m[1]]
            value = float(m[2])
            values[name] = value if name.endswith("_seconds") else int(value)
    return ServerMetrics(**values) if values else None


@dataclass(frozen=True)
class LayerSlots:
    """One MoE layer of a served model: its slots in the plan, and what they serve."""

    block: int
    slots: int
    n_expert: int
    predicted_hit_rate: float | None  # the profile's hit curve at these slots
    selections: int | None  # measured (served with --metrics); None: not counted
    hits: int | None

    @property
    def kind(self) -> str:
        """'whole' (every expert resident: no CPU pass), 'partial' (slots) or 'ram' (no slot)."""
        return "whole" if self.slots >= self.n_expert else ("partial" if self.slots else "ram")

    @property
    def measured_hit_rate(self) -> float | None:
        return self.hits / self.selections if self.selections and self.hits is not None else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"kind": self.kind, "measured_hit_rate": self.measured_hit_rate}


@dataclass(frozen=True)
class ProfileSummary:
    """A stored profile at a glance: where, when, from what, and its coverage curve."""

    path: str
    made_at: float  # the file's modification time
    sources: list[str]  # prompt sets, one per profiler run
    tokens_prefill: int
    tokens_decode: int
    coverage: dict[int, float | None]  # slots per layer -> static hit rate (`moeplug profile analyze`)


@functools.lru_cache(maxsize=8)
def _profile_summary(path: str, mtime: float) -> ProfileSummary:
    from moeplug.profile import analyze, read_profile

    profile = read_profile(path)
    a = analyze(profile)
    return ProfileSummary(path, mtime, [s.label for s in profile.sources], a.tokens_prefill, a.tokens_decode,
                          {n: a.overall_hit_rate("static", n) for n in a.slots})


def profile_summary(path: str | None) -> ProfileSummary | None:
    """None when there is no profile or it cannot be read (the plan panel says so)."""
    if not path or not Path(path).exists():
        return None
    try:
        return _profile_summary(path, Path(path).stat().st_mtime)
    except Exception:
        return None


def placement_why(model: Any) -> str | None:
    """Why an installed model is served as it is, from its last check, and when (None: never checked)."""
    v = model.verdict
    if v is None:
        return None
    since = ", re-planned since" if v.stale(model.plan.server_args) else ""
    return f"{v.why()} ({v.when()}{since})"


@dataclass(frozen=True)
class ServerSnapshot:
    record: ServerRecord
    alive: bool
    healthy: bool
    uptime_s: float
    cache_counters: CacheCounters | None = None
    metrics: ServerMetrics | None = None
    ctx_used: int | None = None  # tokens held by the fullest llama-server slot
    n_ctx: int | None = None  # per llama-server slot
    plan: Plan | None = None  # the plan the server runs, when known
    placement: str = "moeplug"  # serving.installed.PLACEMENTS: stock's where the install's check found the plan slower
    placement_why: str | None = None  # the check's line (serving.installed.Verdict.why), where it ran
    layers: list[LayerSlots] = field(default_factory=list)
    profile: ProfileSummary | None = None  # with_profile only (the dashboard's plan panel)
    vram_bytes: int | None = None  # what the server process holds on every GPU (NVML), None without one
    traffic: Traffic | None = None  # its finished requests, from its log (moeplug.serving.traffic)
    # remote devices (moeplug.serving.liveness): the rpc-servers whose connection the server's side closed
    # (a live server: its next request ends it), whether its work loop waits (/slots unanswered, no CPU used),
    # and after it went down the rpc-servers that take no connection (HOST:PORT -> why)
    hosts_closed: list[str] = field(default_factory=list)
    waiting: bool = False
    hosts_not_answering: dict[str, str] = field(default_factory=dict)
    state_why: str | None = None  # why it is down, unresponsive or lost a host, in one line

    @property
    def vram_budget_bytes(self) -> int | None:
        """The budget its plan was made for (two GPUs: their sum), when known."""
        return self.plan.vram_budget_bytes if self.plan else None

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def state(self) -> str:
        if not self.alive:
            return "down"
        if self.record.launch_interrupted():
            return "unverified"  # its moeplug was killed before checking it: `moeplug stop` it or serve again
        if self.record.launcher is not None:
            return "starting"
        if not self.healthy:
            return "starting/unhealthy"
        if self.hosts_closed:
            return "host lost"  # an rpc-server closed its connection: the next request ends the server
        return "unresponsive" if self.waiting else "healthy"

    @property
    def devices(self) -> list[dict[str, Any]]:
        """Per device of its plan, where the plan splits the layers over several: what `status` shows."""
        return plan_devices(self.plan)

    @property
    def model_present(self) -> bool:
        """False when the model file was deleted or moved while served (it runs on; it cannot start again)."""
        return Path(self.record.model).exists()

    @property
    def cpu_bytes_per_token(self) -> float | None:
        """Expert bytes the CPU read per processed token (batches that ran the cache)."""
        c, m = self.cache_counters, self.metrics
        tokens = (m.prompt_tokens + m.decode_tokens) if m else 0
        return c.cpu_bytes / tokens if c and tokens else None

    def to_json(self) -> dict[str, Any]:
        """`moeplug status --json`'s entry for this server."""
        return self.record.to_json() | {
            "alive": self.alive, "healthy": self.healthy, "state": self.state,
            "model_present": self.model_present,
            "uptime_s": round(self.uptime_s, 1),
            "cache_counters": self.cache_counters.to_json() if self.cache_counters else None,
            "metrics": self.metrics.to_json() if self.metrics else None,
            "ctx_used": self.ctx_used, "n_ctx": self.n_ctx,
            "cpu_bytes_per_token": self.cpu_bytes_per_token,
            "layers": [layer.to_json() for layer in self.layers],
            "vram_bytes": self.vram_bytes, "vram_budget_bytes": self.vram_budget_bytes,
            "traffic": self.traffic.to_json() if self.traffic else None,
            "placement": self.placement, "placement_why": self.placement_why, "devices": self.devices,
            "state_why": self.state_why, "hosts_closed": self.hosts_closed,
            "hosts_not_answering": self.hosts_not_answering,
        }


def plan_devices(plan: Plan | None) -> list[dict[str, Any]]:
    """Per device of a plan that splits the layers over several (in llama.cpp's order, remote ones
    first): its name, where it is (`endpoint`: the rpc-server, None for this machine's), the blocks it
    holds, its whole layers of its MoE layers, its slots and its budget; empty for a one-device plan."""
    return [{"device": d.device, "endpoint": d.endpoint, "remote": d.endpoint is not None, "blocks": list(d.blocks),
             "output": d.output, "moe_layers": d.moe_layers, "whole_layers": d.whole_layers, "slots": d.slots,
             "budget_bytes": d.budget_bytes, "used_bytes": d.used_bytes, "headroom_bytes": d.headroom_bytes}
            for d in (plan.devices or [] if plan else [])]


def rpc_endpoints(args: list[str]) -> list[str]:
    """The rpc-servers (HOST:PORT) a server's command line adds devices from (--rpc), in order."""
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--rpc"]
    return list(dict.fromkeys(e.strip() for value in found for e in value.split(",") if e.strip()))


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    servers: list[ServerSnapshot]
    gpus: list[GpuInfo]
    installed: list[InstalledModel] = field(default_factory=list)

    def server(self, name: str) -> ServerSnapshot | None:
        return next((s for s in self.servers if s.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"servers": [s.to_json() for s in self.servers], "gpus": [g.to_json() for g in self.gpus]}


def _slots_info(found: list[dict[str, Any]] | None) -> tuple[int | None, int | None]:
    """(tokens in the fullest llama-server slot, its n_ctx) from /slots' answer, or (None, None)."""
    try:
        return max(int(s.get("n_prompt_tokens") or 0) for s in found), max(int(s["n_ctx"]) for s in found)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None, None


def _plan_of(record: ServerRecord, installed: InstalledModel | None) -> Plan | None:
    """The plan a server runs: its record's, or for a record without one (an older moeplug's) the
    installed plan when the server was launched with its arguments."""
    if record.plan:
        return record.plan
    planned = list(installed.plan.server_args) if installed else []
    return installed.plan if installed and planned and record.args[-len(planned):] == planned else None


@functools.lru_cache(maxsize=16)
def _model_layers(path: str, mtime: float) -> tuple[list[int], int]:
    """(MoE blocks, experts per layer) of a model file (its header only)."""
    from moeplug.model.inspect import inspect_model

    info = inspect_model(path)
    return info.moe_layers, info.n_expert


@functools.lru_cache(maxsize=16)
def _curves(profile: str, mtime: float, n_layers: int, n_expert: int) -> Any:
    """The planner's hit curves of a profile: float [n_layers, n_expert + 1]."""
    from moeplug.planner.allocate import hit_curves
    from moeplug.profile.format import read_profile

    return hit_curves(read_profile(profile), n_layers, n_expert)


def layer_slots(plan: Plan, model: str, counters: CacheCounters | None) -> list[LayerSlots]:
    """Per MoE layer, in block order: the plan's slots, the profile's predicted hit rate for them
    (the planner's own hit curves), and the measured counts of the cache's /metrics counters (a
    whole layer runs outside the cache: nothing counted there, nothing missed)."""
    try:
        blocks, n_expert = _model_layers(model, Path(model).stat().st_mtime)
    except Exception:  # a model moved or removed under a running server: no per-layer view
        return []
    curves = None
    profile = plan.profile
    if profile and Path(profile).exists():
        try:
            curves = _curves(profile, Path(profile).stat().st_mtime, len(blocks), n_expert)
        except Exception:
            curves = None
    out = []
    for i, (block, slots) in enumerate(zip(blocks, plan.slots_per_layer or [])):
        counted = counters.layers.get(block) if counters else None
        predicted = float(curves[i][min(slots, n_expert)]) if curves is not None else None
        out.append(LayerSlots(block, slots, n_expert, predicted, counted["selections"] if counted else None,
                              counted["hits"] if counted else None))
    return out


_LOGS: dict[tuple[str, int, int], LogTraffic] = {}  # (log, start, pid): each read parses only what is new


def log_traffic(record: ServerRecord) -> Traffic | None:
    """A served model's requests so far, from its log past the launch's probe."""
    key = (record.log, record.traffic_from, record.pid)
    if key not in _LOGS:
        if len(_LOGS) > 64:
            _LOGS.clear()
        _LOGS[key] = LogTraffic(record.log, record.traffic_from)
    return _LOGS[key].read()


def past_probe(record: ServerRecord, counters: CacheCounters | None,
               metrics: ServerMetrics | None) -> tuple[CacheCounters | None, ServerMetrics | None]:
    """The counters less what the launch's context probe added (record.counters_from): the users'
    traffic alone. A server whose counters went below that reading was not this one: taken whole."""
    base = record.counters_from or {}
    cache_base, server_base = base.get("cache"), base.get("server")
    if counters is not None and cache_base and counters.selections >= int(cache_base.get("selections") or 0):
        counters = counters.since(cache_base)
    if metrics is not None and server_base:
        before = ServerMetrics(**{field: int(server_base[name]) if not field.endswith("_seconds") else server_base[name]
                                  for name, field in _SERVER_FIELDS.items() if name in server_base})
        if metrics.prompt_tokens >= before.prompt_tokens and metrics.decode_tokens >= before.decode_tokens:
            metrics = metrics.since(before)
    return counters, metrics


def server_snapshot(record: ServerRecord, installed: dict[str, InstalledModel] | None = None,
                    now: float | None = None, with_profile: bool = False,
                    held: set[str] | None = None) -> ServerSnapshot:
    """Everything about one served model; a server that does not answer is down, never an error.
    with_profile: also summarise its profile (analyzed once per profile file, then cached).
    held: the rpc-servers that running servers hold (not asked whether they answer; None: every
    running server's, read now)."""
    alive = record.alive()
    h = health(record.port, record.host) if alive else None
    healthy = bool(h and h.get("status") == "ok")
    counters = metrics = None
    ctx_used = n_ctx = None
    endpoints = rpc_endpoints(record.args)
    closed = liveness.closed_by_peer(record.pid, endpoints) if alive else []
    waiting, found = False, None
    if alive and healthy and record.launcher is None:  # a verified server: its work loop should answer
        waiting, found = liveness.work_loop_waits(record.url, record.pid, HTTP_TIMEOUT_S)
    elif alive:
        found = client.slots(record.url, timeout=HTTP_TIMEOUT_S)
    if alive and not waiting:
        if "--metrics" in record.args:
            page = fetch_metrics_page(record.port, timeout=HTTP_TIMEOUT_S, host=record.host)
            if page is not None:
                counters, metrics = parse_cache_counters(page), parse_server_metrics(page)
                counters, metrics = past_probe(record, counters, metrics)
        ctx_used, n_ctx = _slots_info(found)
    not_answering: dict[str, str] = {}
    if not alive and endpoints:
        if held is None:
            held = {e for r in read_records() if r.name != record.name and r.alive() for e in rpc_endpoints(r.args)}
        not_answering = liveness.hosts_not_answering([e for e in endpoints if e not in held])
    model = (installed or {}).get(record.name)
    plan = _plan_of(record, model)
    layers = layer_slots(plan, record.model, counters) if plan else []
    profile = profile_summary(model.profile if model else None) if with_profile else None
    return ServerSnapshot(record=record, alive=alive, healthy=healthy,
                          uptime_s=(now or time.time()) - record.started, cache_counters=counters, metrics=metrics,
                          ctx_used=ctx_used, n_ctx=n_ctx, plan=plan, layers=layers,
                          placement=model.placement if model else "moeplug",
                          placement_why=placement_why(model) if model else None, profile=profile, vram_bytes=process_vram_bytes(record.pid) if alive else None,
                          traffic=log_traffic(record) if alive else None, hosts_closed=closed, waiting=waiting,
                          hosts_not_answering=not_answering,
                          state_why=why_not_serving(record, alive, closed, waiting, not_answering, endpoints))


def why_not_serving(record: ServerRecord, alive: bool, closed: list[str], waiting: bool, not_answering: dict[str, str],
              endpoints: list[str]) -> str | None:
    """One line: why a server is down (its log's last error line, and the remote hosts that take no
    connection now), lost a remote host, or waits; None where nothing is amiss."""
    if not alive:
        why = liveness.last_error_line(record.log) or "its log names no error (ended from outside?)"
        hosts = "; ".join(f"{e} {w}" for e, w in not_answering.items())
        return why + (f"; now {hosts}" if hosts else "")
    if closed:
        return (f"{', '.join(closed)} closed {'its connection' if len(closed) == 1 else 'their connections'} (the "
                f"rpc-server ended or restarted): llama.cpp does not connect again, and the next request that needs "
                f"it ends this server; serve it again once the host is back")
    if waiting:
        on = (f"on a remote device ({', '.join(endpoints)}) that stopped answering, or a long batch there"
              if endpoints else "stuck")
        return (f"answers /health, but its work loop answered no /slots in {HTTP_TIMEOUT_S:g} s and used no CPU "
                f"meanwhile: waiting {on}")
    return None


def snapshot(with_gpus: bool = True, with_profiles: bool = False) -> Snapshot:
    """Every served model, the installed ones, and the GPUs, now."""
    installed = list_installed()
    by_name = {m.name: m for m in installed}
    now = time.time()
    records = read_records()
    held = {e for r in records if r.alive() for e in rpc_endpoints(r.args)}
    servers = [server_snapshot(r, by_name, now, with_profiles, held) for r in records]
    return Snapshot(taken_at=now, servers=servers, gpus=gpus() if with_gpus else [], installed=installed)
