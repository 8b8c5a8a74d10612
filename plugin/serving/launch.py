"""Launching the patched llama-server for an installed model, checking it, and keeping track of it.

A running server is a record in ~/.local/state/moeplug/servers/NAME.json (pid, port, log, the
argument list, what its log said about the expert cache and its buffers); `moeplug status` and
`moeplug stop` read those records. The server runs in its own session, so it outlives moeplug.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError, NotApplicableError
from moeplug.core.fsutil import write_text_atomic
from moeplug.planner.record import Plan
from moeplug.core.paths import logs_dir, state_dir
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.core.runlog import log_tail
from moeplug.serving import client
from moeplug.serving.server import HOST, Server, server_argv, start_server, url_of
from moeplug.serving.traffic import probe_end

# "L layers x N slots, ..."; with whole layers or layers that differ,
# "L layers x N0-N1 slots (S in all, F whole layers), ..." (N0- only when they differ); uploaded to
# one device ("CUDA0") or, with layers split over GPUs, to each in layer order ("CUDA0, CUDA1")
ENGAGED_RE = re.compile(r"moe-cache: (\d+) layers x (?:(\d+)-)?(\d+) slots(?: \((\d+) in all, (\d+) whole layers\))?, "
                        r"([\d.]+) MiB uploaded to (\S+(?:, \S+)*) in ([\d.]+) s")
NOT_ENGAGED_RE = re.compile(r"moe-cache: not engaged, running without it: (.*)")
# and, where the device computes some misses (--moe-cache-stream), ", L layers stream P% of their misses"
STREAM_RE = re.compile(r"moe-cache: \d+ layers x .*, (\d+) layers stream (\d+)% of their misses")
# and, where the CPU computes a layer's misses while the GPU computes its slots, ", L layers compute slots and
# misses at once"
OVERLAP_RE = re.compile(r"moe-cache: \d+ layers x .*, (\d+) layers compute slots and misses at once")
# and, where the GPU computes a layer's misses too, reading them from pinned RAM in place (LLAMA_MOE_CACHE_DIRECT=1),
# ", L layers read their misses in place"
DIRECT_RE = re.compile(r"moe-cache: \d+ layers x .*, (\d+) layers read their misses in place")
BUFFER_RE = re.compile(r"(\S+) (model|KV|compute) buffer size =\s+([\d.]+) MiB")


@dataclass
class CacheStatus:
    engaged: bool
    layers: int = 0
    slots: int = 0  # per layer, the most
    slots_min: int = 0
    slots_total: int = 0
    whole_layers: int = 0  # every expert resident: no CPU pass
    mib_uploaded: float = 0.0
    device: str = ""  # "CUDA0", or "CUDA0, CUDA1" where the slots live on several
    seconds: float = 0.0
    reason: str = ""
    streamed_layers: int = 0  # layers whose GPU computes some misses from host memory
    stream_percent: int = 0  # the share of their misses it computes
    overlapped_layers: int = 0  # layers whose CPU computes their misses while the GPU computes their slots
    direct_layers: int = 0  # layers whose GPU computes their misses too, read from pinned RAM in place


def parse_cache_line(log: str) -> CacheStatus | None:
    """What the server's log says about the expert cache, or None when it was not asked for."""
    m = ENGAGED_RE.search(log)
    if m:
        layers, most = int(m[1]), int(m[3])
        least = int(m[2]) if m[2] else most
        total = int(m[4]) if m[4] else layers * most
        whole = int(m[5]) if m[5] else 0
        s = STREAM_RE.search(log)
        o = OVERLAP_RE.search(log)
        d = DIRECT_RE.search(log)
        return CacheStatus(True, layers, most, least, total, whole, float(m[6]), m[7], float(m[8]),
                           streamed_layers=int(s[1]) if s else 0, stream_percent=int(s[2]) if s else 0,
                           overlapped_layers=int(o[1]) if o else 0, direct_layers=int(d[1]) if d else 0)
    m = NOT_ENGAGED_RE.search(log)
    if m:
        return CacheStatus(False, reason=m[1].strip())
    return None


def cache_summary(cache: dict[str, Any] | None) -> str:
    """One line for a server's expert cache (a CacheStatus as JSON): 'off', 'not engaged: why', or
    'LAYERSxSLOTS on DEVICE' and the layers whose GPU computes a share of their misses."""
    if not cache:
        return "off"
    if not cache.get("engaged"):
        return f"not engaged: {cache.get('reason', '')}"
    return f"{cache['layers']}x{slot_range(cache)} on {cache['device']}{streamed_text(cache)}"


def slot_range(cache: dict[str, Any]) -> str:
    """An engaged cache's slots per layer: '8', or '4-10' where layers differ."""
    lo, hi = cache.get("slots_min") or cache["slots"], cache["slots"]
    return f"{hi}" if lo == hi else f"{lo}-{hi}"


def streamed_text(cache: dict[str, Any]) -> str:
    """', N layers stream P% of their misses' where the GPU computes some misses (--moe-cache-stream), ', N layers
    read their misses in place' where it computes them all from pinned RAM (LLAMA_MOE_CACHE_DIRECT=1)."""
    n, direct = cache.get("streamed_layers") or 0, cache.get("direct_layers") or 0
    return ((f", {n} layers stream {cache.get('stream_percent', 0)}% of their misses" if n else "")
            + (f", {direct} layers read their misses in place" if direct else ""))


def parse_buffers(log: str) -> dict[str, dict[str, float]]:
    """{'model': {'CPU': MiB, ...}, 'KV': {...}, 'compute': {...}} as llama-server logs them."""
    out: dict[str, dict[str, float]] = {}
    for m in BUFFER_RE.finditer(log):
        kind = out.setdefault(m[2], {})
        kind[m[1]] = kind.get(m[1], 0.0) + float(m[3])
    return out


@dataclass
class ServerRecord:
    name: str
    model: str
    pid: int
    port: int
    log: str
    args: list[str]
    started: float
    build_id: str
    cache: dict[str, Any] | None = None
    buffers: dict[str, dict[str, float]] = field(default_factory=dict)
    plan: Plan | None = None  # the plan it runs; None: not known
    launcher: int | None = None  # pid of the moeplug still verifying it; None once verified
    host: str = HOST  # the address it listens on
    traffic_from: int = 0  # where its users' requests start in the log: past the launch's probe (moeplug.serving.traffic)
    # /metrics as the launch's context probe left it ({"cache": CacheCounters JSON, "server": {llama-server's
    # sample name less "llamacpp:": value}}): moeplug.serving.monitor counts from there, so the probe's full-context
    # request is not shown as the users' hit rate or throughput; None: counted from the server's start
    counters_from: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def launch_interrupted(self) -> bool:
        """The moeplug that launched it died before verifying it (killed, or the machine's OOM killer)."""
        return self.launcher is not None and not pid_alive(self.launcher)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"url": self.url, "plan": self.plan.to_json() if self.plan else None}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServerRecord:
        """A record as _write_record wrote it (its plan as Plan.to_json())."""
        return cls(**(doc | {"plan": Plan.from_json(doc["plan"]) if doc.get("plan") else None}))

    def alive(self) -> bool:
        return pid_alive(self.pid) and _cmdline(self.pid).startswith(self.args[0])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def servers_dir() -> Path:
    return state_dir() / "servers"


def record_path(name: str) -> Path:
    return servers_dir() / f"{name}.json"


def read_records() -> list[ServerRecord]:
    out = []
    for p in sorted(servers_dir().glob("*.json")) if servers_dir().exists() else []:
        try:
            out.append(ServerRecord.from_json(json.loads(p.read_text())))
        except (ValueError, TypeError):
            continue  # a record from another version: ignored, not fatal
    return out


def find_record(name: str) -> ServerRecord | None:
    p = record_path(name)
    return ServerRecord.from_json(json.loads(p.read_text())) if p.exists() else None


@contextlib.contextmanager
def model_lock(name: str, progress: ProgressFn = silent, poll_s: float = 0.2) -> Iterator[None]:
    """One install, launch or re-profile per model at a time: a second one waits for the first
    (progress hears that it waits, once)."""
    path = state_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        waited = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    progress(Note(f"waiting for another moeplug working on '{name}' (installing, launching or "
                                  f"re-profiling it)"))
                    waited = True
                time.sleep(poll_s)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


RECORD_FLAG = "--moe-cache-record"  # llama-server counts the router's selections for /moe-cache/profile


def served_args(server_args: list[str], metrics: bool = False, record: bool = False) -> list[str]:
    """The flags moeplug serves a model with besides model, host and port: its plan's server args,
    and -lv 4 (the log then holds the buffer sizes, about 20 lines per request); record: count
    the router's selections for `moeplug reprofile` (RECORD_FLAG)."""
    return ["-lv", "4", *(["--metrics"] if metrics else []), *([RECORD_FLAG] if record else []), *server_args]


def served_argv(binary: Path, model: Path, port: int | str, server_args: list[str], metrics: bool = False) -> list[str]:
    """The whole command line of a served model: what launch_verified runs, and what the proxy hooks
    (moeplug.hooks) write for llama-swap (port "${PORT}")."""
    return server_argv(binary, model, port, served_args(server_args, metrics))


@dataclass(frozen=True)
class ServeOptions:
    """How a served model's llama-server is started: where it listens, what it counts, and whether it
    may run without the cache where the cache cannot engage (launch_verified)."""

    port: int | None = None  # None: a free one
    host: str = HOST
    allow_fallback: bool = False
    metrics: bool = True  # the cache's slot-hit counters on /metrics
    record: bool | None = None  # the router's selections for `moeplug reprofile` (None: where the build can)

    def launch_options(self) -> dict[str, Any]:
        """launch_verified's keywords for these options."""
        return dict(port=self.port, host=self.host, allow_fallback=self.allow_fallback, metrics=self.metrics,
                    record=self.record)


def launch_verified(name: str, model: Path, binary: Path, build_id: str, server_args: list[str], ctx: int,
                    port: int | None = None, allow_fallback: bool = False, env: dict[str, str] | None = None,
                    timeout: float = 300, metrics: bool = False, plan: Any = None,
                    record: bool | None = False, host: str = HOST) -> ServerRecord:
    """Start a served model's llama-server detached (server.start_server), wait for /health, check
    the cache engaged, probe the context, and record it for `status` and `stop`.
    metrics: serve /metrics, with the cache's slot-hit counters (moeplug.serving.metrics). plan: the plan
    server_args come from (a Plan or its JSON), kept in the record (moeplug.serving.monitor shows its slots).
    record: count the router's selections (RECORD_FLAG; the build must have it); None: where the build
    has it (what `moeplug serve` and `install` do unless told --no-record).
    The probe's own routing counts are zeroed once it passed, and /metrics as it left them is kept in
    the record (counters_from), so that what is counted and shown is the users' traffic alone.
    host: where it listens (127.0.0.1 unless the user asked; server.exposure_warning says what else means)."""
    existing = find_record(name)
    if existing and existing.alive():
        if not existing.launch_interrupted():
            raise MoeplugError(f"'{name}' is already served at {existing.url} (pid {existing.pid}); "
                               f"'moeplug stop {name}' first")
        stop(name)  # left running, unverified, by a moeplug that was killed: replaced
    if record is None:
        record = can_record(binary)
    if record:
        if not can_record(binary):
            raise MoeplugError(f"{binary} has no {RECORD_FLAG}: this build cannot count routing for 'moeplug "
                               f"reprofile'; serve with --no-record, or rebuild ('moeplug native build')")
    log_path = logs_dir() / f"server-{name}.log"
    server = start_server(binary, model, log_path, served_args(server_args, metrics, record), port=port, ctx=None,
                          detached=True, env=env, host=host)
    proc, port, args = server.proc, server.port, server.args
    started = time.time()
    plan_record = Plan.from_json(plan) if isinstance(plan, dict) else plan
    # recorded before it is verified, so that a moeplug killed now leaves a server `status` shows
    # and `stop` (or the next launch) ends, never an unknown one
    pending = ServerRecord(name=name, model=str(model), pid=proc.pid, port=port, log=str(log_path), args=args,
                           started=started, build_id=build_id, plan=plan_record, launcher=os.getpid(), host=host)
    try:
        _write_record(pending)
        server.wait_healthy(timeout=timeout)
        text = log_path.read_text(errors="replace")
        keep_pinned_refusal(text)
        cache = parse_cache_line(text)
        if "--moe-cache-slots" in server_args and not (cache and cache.engaged) and not allow_fallback:
            why = cache.reason if cache else "the server did not report on the cache"
            raise NotApplicableError(f"the expert cache did not engage: {why}. Re-plan with a smaller --vram-budget "
                                     f"or --ctx, or pass --allow-fallback to serve without it (log: {log_path})")
        _probe_context(server, ctx)
        traffic_from = probe_end(log_path)
        counters_from = _after_probe(server.url, metrics, record)
    except BaseException:
        server.stop()
        record_path(name).unlink(missing_ok=True)
        raise
    verified = replace(pending, cache=asdict(cache) if cache else None, buffers=parse_buffers(text), launcher=None,
                       traffic_from=traffic_from, counters_from=counters_from)
    _write_record(verified)
    return verified


def keep_pinned_refusal(log_text: str) -> str | None:
    """Where a server's log shows pinned host memory refused (llama.cpp then falls back to pageable
    buffers without a word more), keep the line for this machine's next plans, which then do not rely on
    pinned memory (machine.probes.pinned_memory); returns the line, or None."""
    from moeplug.core.fsutil import write_text_atomic
    from moeplug.machine.probes import pinned_refusal_marker, pinned_refused

    line = pinned_refused(log_text)
    if line is not None:
        marker = pinned_refusal_marker()
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(marker, line + "\n")
    return line


def can_record(binary: Path) -> bool:
    """Whether a llama-server build has RECORD_FLAG (every patched build of this series does): from
    the features its build recorded (build.json beside bin/), else from its --help."""
    from moeplug.native.features import detect_features

    manifest = binary.parent.parent / "build.json"
    try:
        recorded = json.loads(manifest.read_text()).get("features") if manifest.is_file() else None
    except (OSError, ValueError):
        recorded = None
    features = recorded if isinstance(recorded, dict) else detect_features(binary)
    return bool(features.get("moe_cache_record"))


def _after_probe(url: str, metrics: bool, record: bool) -> dict[str, Any] | None:
    """After the launch's context probe: zero the routing it recorded (record), and return /metrics'
    counters as it left them (metrics; None without), so neither counts the probe as traffic."""
    if record:
        try:
            client.moe_profile(url, reset=True)
        except MoeplugError as exc:
            raise MoeplugError(f"after its context probe: {exc}") from None
    if not metrics:
        return None
    from moeplug.serving.metrics import parse_cache_counters

    page = client.metrics_page(url, timeout=10)
    if page is None:
        return None  # counted from the start
    cache = parse_cache_counters(page)
    server = {m[1]: float(m[2]) for m in map(_PLAIN_SAMPLE_RE.match, page.splitlines()) if m}
    return {"cache": cache.to_json() if cache else None, "server": server}


_PLAIN_SAMPLE_RE = re.compile(r"^llamacpp:(\w+) ([-+\d.eE]+)$")  # llama-server's own counters: name value


def _write_record(record: ServerRecord) -> None:
    doc = record.to_json()
    del doc["url"]
    write_text_atomic(record_path(record.name), json.dumps(doc, indent=2) + "\n")


def record_plan(name: str, plan: Any) -> None:
    """Keep a new plan in a running server's record where the server runs its flags already (a re-plan
    that changed what the plan says, not what the server runs)."""
    record = find_record(name)
    if record is not None:
        _write_record(replace(record, plan=plan))


def _probe_context(server: Server, ctx: int) -> None:
    """A request that fills the context, so an out-of-memory shows now, not on the first big prompt."""
    try:
        props = client.props(server.url)
        n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or ctx)
        token = client.tokenize(server.url, "a", timeout=10)[-1]
        server.complete([token] * (min(ctx, n_ctx) - 8), n_predict=1)  # type: ignore[arg-type]
    except (MoeplugError, *client.REQUEST_ERRORS, ValueError, KeyError, IndexError) as exc:
        raise MoeplugError(f"the server failed a {ctx}-token context probe: {exc}; "
                           f"{log_tail(server.log_path, 2)}") from None


def stop(name: str, timeout: float = 15) -> bool:
    """Stop a served model; False when it was not running."""
    record = find_record(name)
    if record is None:
        return False
    running = record.alive()
    if running:
        os.killpg(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while record.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if record.alive():
            os.killpg(record.pid, signal.SIGKILL)
    record_path(name).unlink(missing_ok=True)
    return running
