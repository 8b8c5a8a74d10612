"""`moeplug calibrate [MODEL]`: what this machine's CPU and bus cost, measured with the model's own build,
kept in one JSON file per machine for the planner's cost model (moeplug.planner.costs.CostModel).

The planner's figures were fitted on one machine (an H200 on PCIe 5, 16 cores); a user's CPU and bus
may be several times slower or faster. A calibration measures them here, in well under a minute:

Each figure comes from the measurement that isolates it, on the model being served (install passes
the model it installs; `moeplug calibrate` with no model takes the largest installed one), and the
file records how (`methods`, METHOD_*) and on which model (`model`):

- `cpu_expert_bytes_per_s`, `round_trip_s`: with a GPU and a CUDA build, three llama-bench decode runs
  with the dense weights on the GPU (`-ngl 999`): every layer's experts in RAM (`-ncmoe` over every
  block); the experts of the last blocks in VRAM (as many as fit, at most half the MoE layers); and
  those blocks' experts in VRAM but their down projections in RAM (`-ot`). A layer whose experts the
  CPU computes costs a round trip (its activations to the CPU, the result back) plus its experts'
  bytes at the CPU's rate, which is what the planner charges; the first and third runs differ in
  the moved layers' up and gate projections alone (the rate), the third and second in their round
  trips and down projections (the round trip): _split_costs, METHOD_GPU_SPLIT. Where that does not
  resolve, the rate comes from the first two runs at the fitted round trip (METHOD_GPU_LAYERS).
  Without a GPU (or where no layer's experts fit beside the dense weights), the rate comes from
  llama-bench with every weight on the CPU (`-ngl 0`): the time per token turned into bytes per second
  over the weights a token reads (the experts it uses and the other weights, taken at the experts'
  rate); attention and a token's fixed costs stay in it, so it reads low (0.79x of the GPU runs' on
  an H200), and very low on a tiny model (METHOD_CPU_RUN). That run is made with a GPU too, its note
  beside the GPU runs' figure.
- `prompt_upload_bytes_per_s`: a 512-token prompt batch (one ubatch) uploads every expert of a layer
  in RAM (stock's path, with the load mode the planner would choose): the moved layers' expert bytes
  over the difference in the batch's time between the first two GPU runs.
- `h2d_bytes_per_s`: copies of 256 MiB from pinned memory to GPU 0 through libcudart (moeplug.machine.bus).
- `gpu_miss_bytes_per_s`: the GPU computing misses read over the bus from host memory; llama-bench has
  no way to run that path, so it is None with a note (the planner keeps its fitted share).
- `rpc_hop_s`, with remote devices named (`--rpc HOST:PORT,...`, machine.rpc): llama-bench on the demo
  model (tiny: its compute is negligible) with every layer on the first host's first device
  (`-rpc HOST:PORT -dev RPC0 -ngl 99`), against every layer here (`-ngl 0`), one thread each (the
  threads' synchronisation would outweigh the hop on so small a model); the difference in the time
  per decoded token, 0 or more: one round trip a token through llama.cpp's RPC path. Measured against
  the first host only, whose endpoint `rpc` keeps; every host is asked for its devices first, so
  that one that does not answer is an error before anything is measured.

Anything not measured is None, and a note says why ("no GPU: the bus is not measured").

API (for the planner's side, `install` and the CLI):

    Calibration                                  the record; to_json() / Calibration.from_json(doc)
    calibrate(build, model=None, threads=None, progress=silent, rpc=()) -> Calibration
        measures now (build: a moeplug.native.BuildResult; model None: the demo model, noted;
        rpc: machine.rpc.RpcHost entries, the hop to the first measured too)
    remeasure_reason(cal) -> str | None          why a stored calibration is measured again before a plan
                                                 trusts it (none, the demo's, an older moeplug's)
    measure_rpc_hop(build, hosts, done=None, progress=silent) -> (seconds, note, runs)
                                                 the hop alone (calibrate's part with rpc)
    machine_fingerprint(build_id) -> (str, dict) this machine's fingerprint and identity
                                                 (moeplug.machine.fingerprint)
    calibration_dir() -> Path                    data_dir()/calibration
    calibration_path(fingerprint) -> Path        calibration_dir()/FINGERPRINT.json
    write_calibration(cal, path=None) -> Path    atomically; default calibration_path(cal.fingerprint)
    read_calibration(path) -> Calibration        a written or hand-written file, checked: one-line
                                                 MoeplugError naming the file and the key otherwise
    stored_calibration(build) -> Calibration | None
                                                 this machine's file for the build's fingerprint
    costs_for(build, calibration=None) -> CostModel
                                                 the planner's costs: a file given, else this
                                                 machine's, else the GPU machine's fitted figures

The command's action (a model resolved, this fingerprint's file reused unless --force) is
operations.actions.calibrate_model.

A hand-written file (to plan for another machine) needs only `cpu_expert_bytes_per_s`; every other
key may be left out (None, or empty) and `h2d_bytes_per_s` is the other one worth giving. Keys are
checked: unknown keys, wrong types and non-positive rates are errors.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from moeplug.machine.backend import Backend
from moeplug.core.errors import MoeplugError, NotApplicableError
from moeplug.core.fsutil import write_text_atomic
from moeplug.core.output import human_bytes
from moeplug.core.paths import data_dir
from moeplug.core.progress import Note, ProgressFn, Step, silent
from moeplug.machine.fingerprint import machine_fingerprint
from moeplug.machine.gpu import gpus
from moeplug.machine.probes import available_ram_bytes, usable_cores
from moeplug.model.inspect import ModelInfo, inspect_model
from moeplug.planner.costs import DEFAULT_COSTS, CostModel

__all__ = ["Calibration", "calibrate", "calibration_dir", "calibration_path", "cost_model", "costs_for",
           "machine_fingerprint", "measure_rpc_hop", "read_calibration", "stored_calibration", "write_calibration"]

GEN_TOKENS = 16  # tokens each decode run generates (after llama-bench's warm-up)
REPETITIONS = 5  # runs of each test; the median counts (a shared machine's outliers drop out)
PROMPT_BATCH = 512  # one prompt batch of stock's default ubatch
RUN_TIMEOUT_S = 300
HOP_TOKENS = 32  # tokens each run of the hop generates
HOP_TIMEOUT_S = 120  # a hop run (the demo model: seconds); past it, the host hangs
GIB = 1 << 30
VRAM_HEADROOM = 1536 << 20  # KV cache, compute buffer and CUDA's own memory beside the weights
TASK = "calibrating"

# how each figure was measured (Calibration.methods): what a later install trusts or measures again
METHOD_CPU_RUN = "cpu-run"  # llama-bench with every weight on the CPU: attention and fixed costs charged to experts
METHOD_GPU_SPLIT = "gpu-split"  # the three GPU runs: rate and round trip each from what isolates it (_split_costs)
METHOD_GPU_LAYERS = "gpu-layers"  # two GPU runs, more and fewer layers' experts in RAM
METHOD_PINNED = "pinned-copies"  # 256 MiB copies from pinned memory to GPU 0 (moeplug.machine.bus)
METHOD_RPC_HOP = "rpc-hop"  # the demo model on the first remote device against here (measure_rpc_hop)

# the keys of a calibration file: (type, what a value must be); rates must be positive
RATES = ("cpu_expert_bytes_per_s", "h2d_bytes_per_s", "prompt_upload_bytes_per_s", "gpu_miss_bytes_per_s")
CLI_KEYS = ("path", "reused")  # what `moeplug calibrate --json` adds beside the record: read back, ignored


@dataclass
class Calibration:
    """What this machine costs the planner, measured (or written by hand). Rates in bytes/s, times
    in seconds; None: not measured (the notes say why)."""

    fingerprint: str  # moeplug.machine.fingerprint; "" in a hand-written file that gives none
    cpu_expert_bytes_per_s: float  # expert bytes the CPU computes per second at `threads`
    round_trip_s: float | None = None  # a layer's activations to the CPU and back (decode)
    h2d_bytes_per_s: float | None = None  # pinned host memory to GPU 0
    prompt_upload_bytes_per_s: float | None = None  # a prompt batch's expert uploads, stock's path
    gpu_miss_bytes_per_s: float | None = None  # the GPU on misses read from host memory
    rpc_hop_s: float | None = None  # a step's activations to a remote device (--rpc) and back
    rpc: list[str] = field(default_factory=list)  # the rpc-servers (HOST:PORT) rpc_hop_s was measured to
    measured_at: str | None = None  # ISO 8601, UTC
    threads: int | None = None  # the CPU threads the figures hold for
    build_id: str | None = None
    model: str | None = None  # the model measured with
    machine: dict[str, Any] = field(default_factory=dict)  # {"gpus": [...], "cpu": {...}, "ram_gib": N}
    notes: list[str] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # each llama-bench run: its flags and times
    # figure -> how it was measured (METHOD_*); a figure absent: not measured, or a file written by hand
    methods: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any], source: str = "calibration") -> Calibration:
        """The record from a JSON object, checked (see read_calibration); `source` names it in errors."""
        return cls(**_checked(doc, source))


# ---------------------------------------------------------------------------------------------
# the file


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _checked(doc: Any, source: str) -> dict[str, Any]:
    """The keys of a calibration document, type-checked; one-line MoeplugErrors name `source` and the key."""
    if not isinstance(doc, dict):
        raise MoeplugError(f"{source}: not a calibration: expected a JSON object, got {type(doc).__name__}")
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(k for k in doc if k not in known and k not in CLI_KEYS)
    if unknown:
        raise MoeplugError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    if "cpu_expert_bytes_per_s" not in doc:
        raise MoeplugError(f"{source}: key 'cpu_expert_bytes_per_s' is missing (the CPU's expert bytes per second)")
    out: dict[str, Any] = {}

    def bad(key: str, expected: str) -> MoeplugError:
        return MoeplugError(f"{source}: key {key!r}: expected {expected}, got {json.dumps(doc[key])[:40]}")

    for key, value in doc.items():
        if key in CLI_KEYS:
            continue
        optional = key != "cpu_expert_bytes_per_s"
        if value is None and optional and key not in ("fingerprint", "machine", "notes", "runs", "rpc", "methods"):
            out[key] = None
        elif key in RATES:
            if not _number(value) or value <= 0:
                raise bad(key, "a positive number of bytes per second")
            out[key] = float(value)
        elif key in ("round_trip_s", "rpc_hop_s"):
            if not _number(value) or value < 0:
                raise bad(key, "a number of seconds, 0 or more")
            out[key] = float(value)
        elif key == "threads":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, "a positive whole number")
            out[key] = value
        elif key in ("fingerprint", "measured_at", "build_id", "model"):
            if not isinstance(value, str):
                raise bad(key, "a string")
            out[key] = value
        elif key == "machine":
            if not isinstance(value, dict):
                raise bad(key, "an object")
            out[key] = value
        elif key == "notes":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise bad(key, "a list of strings")
            out[key] = value
        elif key == "runs":
            if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
                raise bad(key, "a list of objects")
            out[key] = value
        elif key == "rpc":
            out[key] = _endpoints(value, bad(key, "a list of rpc-servers, HOST:PORT"))
        elif key == "methods":
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                raise bad(key, "an object of figure names to how each was measured")
            out[key] = value
    out.setdefault("fingerprint", "")
    return out


def _endpoints(value: Any, error: MoeplugError) -> list[str]:
    """A calibration's `rpc`: a list of HOST:PORT strings, as machine.rpc writes them; `error` otherwise."""
    from moeplug.machine.rpc import parse_rpc

    if not isinstance(value, list) or not all(isinstance(e, str) for e in value):
        raise error
    try:
        return [h.endpoint for h in parse_rpc(",".join(value))] if value else []
    except MoeplugError:
        raise error from None


def calibration_dir() -> Path:
    return data_dir() / "calibration"


def calibration_path(fingerprint: str) -> Path:
    return calibration_dir() / f"{fingerprint}.json"


def write_calibration(cal: Calibration, path: Path | None = None) -> Path:
    """Write `cal` atomically (default: its fingerprint's file) and return where."""
    dest = path or calibration_path(cal.fingerprint)
    write_text_atomic(dest, json.dumps(cal.to_json(), indent=2) + "\n")
    return dest


def read_calibration(path: Path) -> Calibration:
    """A calibration file, written by `moeplug calibrate` or by hand: only cpu_expert_bytes_per_s is
    needed. A file that cannot be read, is not JSON, or has an unknown key, a key of the wrong type
    or a non-positive rate is a one-line MoeplugError naming the file (and the key)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MoeplugError(f"{path}: cannot read the calibration file ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise MoeplugError(f"{path}: not a calibration file (not UTF-8 text)") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise MoeplugError(f"{path}: not a calibration file: not JSON ({exc})") from None
    return Calibration.from_json(doc, str(path))


def stored_calibration(build: Any) -> Calibration | None:
    """This machine's calibration with `build` (a BuildResult): the file of the current fingerprint,
    or None where there is none (a new machine, GPU, driver or build). A damaged file is an error
    that says to measure again."""
    path = calibration_path(machine_fingerprint(build.build_id)[0])
    if not path.exists():
        return None
    try:
        return read_calibration(path)
    except MoeplugError as exc:
        raise MoeplugError(f"{exc}; 'moeplug calibrate --force' measures again") from None


# ---------------------------------------------------------------------------------------------
# measuring


@dataclass
class _Bench:
    """One llama-bench process: the flags and what it measured (seconds; None: the test was not run)."""

    label: str
    args: list[str]
    token_s: float | None = None  # per generated token
    batch_s: float | None = None  # per prompt batch of PROMPT_BATCH tokens

    def to_json(self) -> dict[str, Any]:
        return {"run": self.label, "args": self.args,
                "ms_per_token": None if self.token_s is None else round(self.token_s * 1e3, 4),
                "ms_per_prompt_batch": None if self.batch_s is None else round(self.batch_s * 1e3, 4)}


class _BenchFailed(Exception):
    pass


def _run_bench(tool: Path, model: Path, bench: _Bench, timeout: float = RUN_TIMEOUT_S) -> _Bench:
    cmd = [str(tool), "-m", str(model), "-o", "json", "-r", str(REPETITIONS), *bench.args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise _BenchFailed(f"llama-bench ran past {timeout:g} s") from None
    except OSError as exc:
        raise _BenchFailed(f"llama-bench did not start ({exc.strerror or exc})") from None
    if r.returncode != 0:
        last = [line.strip() for line in r.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        raise _BenchFailed(f"llama-bench exited with {r.returncode}: {last[0][:200]}")
    try:
        tests = json.loads(r.stdout)
        for t in tests:
            median_s = statistics.median(t["samples_ns"]) / 1e9
            if t["n_gen"] > 0 and t["n_prompt"] == 0:
                bench.token_s = median_s / t["n_gen"]
            elif t["n_prompt"] > 0 and t["n_gen"] == 0:
                bench.batch_s = median_s
    except (ValueError, KeyError, TypeError, statistics.StatisticsError) as exc:
        raise _BenchFailed(f"llama-bench's output unread ({type(exc).__name__}: {exc})") from None
    return bench


def _per_token_bytes(info: ModelInfo) -> tuple[int, int]:
    """(expert bytes, other weight bytes) one decoded token reads: n_expert_used experts of every MoE
    layer; every other weight but the token embedding, of which one row (all of it where the output
    matrix is tied to it)."""
    experts = sum(info.n_expert_used * layer.bytes_per_expert for layer in info.layers)
    expert_names = {t.name for layer in info.layers for t in layer.tensors.values()}
    names = {t.name for t in info.tensors}
    other = 0
    for t in info.tensors:
        if t.name in expert_names:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            other += t.n_bytes // max(1, t.shape[-1])  # one row: get_rows
        else:
            other += t.n_bytes
    return experts, other


def _moved_blocks(info: ModelInfo, free_vram: int) -> list[int]:
    """The last blocks whose experts go to VRAM in the second GPU run: as many MoE layers as fit beside
    the other weights and VRAM_HEADROOM, at most half of them; [] where none fits."""
    room = free_vram - info.non_expert_bytes - VRAM_HEADROOM
    moved: list[int] = []
    for layer in sorted(info.layers, key=lambda x: -x.block)[: len(info.layers) // 2]:
        if layer.expert_bytes > room:
            break
        room -= layer.expert_bytes
        moved.append(layer.block)
    return moved


def _down_in_ram(blocks: list[int]) -> str:
    """llama-bench's -ot value that puts these blocks' routed down projections (plain or chunked) in RAM."""
    return "blk\\.(" + "|".join(str(b) for b in sorted(blocks)) + ")\\.ffn_down_(ch|)exps=CPU"


def _down_bytes_per_expert(layer: Any) -> int:
    """One expert's bytes in a layer's down projection (its bias too, where it has one)."""
    return sum(t.n_bytes // t.shape[-1] for key, t in layer.tensors.items() if key.startswith("ffn_down_"))


@dataclass
class _Split:
    """The CPU's expert rate beside the GPU and a layer's round trip, from the three GPU runs; None where a
    figure was not resolved (note says why)."""

    cpu_rate: float | None
    round_trip: float | None
    method: str
    note: str


def _split_costs(info: ModelInfo, moved: list[int], all_ram_s: float, fewer_s: float, split_s: float,
                 fallback_round_trip: float = DEFAULT_COSTS.round_trip_s) -> _Split:
    """What a token costs per MoE layer whose experts the CPU computes, taken apart. Three decode runs with
    the dense weights on the GPU: every layer's experts in RAM (all_ram_s), the `moved` layers' experts in
    VRAM (fewer_s), and those layers' experts in VRAM but their down projections in RAM (split_s). A moved
    layer costs `round trip + its experts' bytes / rate` in the first run, `round trip + its down
    projections' bytes / rate` in the third (the activations still go to the CPU and back once), nothing
    in the second:

        all_ram - split = (expert bytes - down bytes) / rate      -> the CPU's rate beside the GPU
        split - fewer   = layers x round trip + down bytes / rate -> the round trip

    Both are what the planner charges a layer with misses on the CPU (planner.allocate), measured on the
    model itself at the server's threads; neither carries attention or a token's fixed costs, which the
    all-CPU run charges to the experts. Where the two runs with experts in RAM do not differ enough to
    resolve a rate, the rate comes from the first two runs with the round trip at `fallback_round_trip`."""
    layers = {layer.block: layer for layer in info.layers}
    used = info.n_expert_used
    full = sum(used * layers[b].bytes_per_expert for b in moved)
    down = sum(used * _down_bytes_per_expert(layers[b]) for b in moved)
    runs = (f"{all_ram_s * 1e3:.3f} ms a token with every layer's experts in RAM, {fewer_s * 1e3:.3f} with the last "
            f"{len(moved)} layers' in VRAM, {split_s * 1e3:.3f} with their down projections alone in RAM")
    moved_s, split_saved = all_ram_s - fewer_s, all_ram_s - split_s
    # the up and gate projections left in VRAM must save at least a twentieth of what the whole layers saved
    # for their bytes to give a rate: below that, a run's noise is the figure
    if 0 < down < full and moved_s > 0 and split_saved > 0.05 * moved_s:
        rate = (full - down) / split_saved
        round_trip = (split_s - fewer_s - down / rate) / len(moved)
        if round_trip < 0:
            return _Split(rate, 0.0, METHOD_GPU_SPLIT,
                          f"CPU beside the GPU: {human_bytes(full - down)} of up and gate projections a token "
                          f"cost {split_saved * 1e3:.3f} ms ({runs}); round trip taken as 0: the down projections "
                          f"alone cost no more than their bytes at that rate")
        return _Split(rate, round_trip, METHOD_GPU_SPLIT,
                      f"CPU beside the GPU and round trip: {human_bytes(full - down)} of up and gate projections a "
                      f"token cost {split_saved * 1e3:.3f} ms, and {len(moved)} layers' down projections "
                      f"({human_bytes(down)}) {(split_s - fewer_s) * 1e3:.3f} ms ({runs})")
    if moved_s > len(moved) * fallback_round_trip:
        rate = full / (moved_s - len(moved) * fallback_round_trip)
        return _Split(rate, None, METHOD_GPU_LAYERS,
                      f"CPU beside the GPU: {len(moved)} layers' experts ({human_bytes(full)} a token) cost "
                      f"{moved_s * 1e3:.3f} ms less their round trips at the fitted {fallback_round_trip * 1e6:.0f} us "
                      f"({runs}); the down projections alone did not resolve the round trip")
    return _Split(None, None, METHOD_GPU_LAYERS,
                  f"CPU beside the GPU not resolved: {len(moved)} layers' experts in VRAM saved "
                  f"{moved_s * 1e3:.3f} ms a token ({runs}); the all-CPU run's figure stands")


def _now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def measure_rpc_hop(build: Any, hosts: tuple[Any, ...], done: Callable[[], None] | None = None,
                    progress: ProgressFn = silent) -> tuple[float, str, list[_Bench]]:
    """The hop to a remote device (CostModel.rpc_hop_s): llama-bench on the demo model with every layer
    on the first host's first device, then with every layer here, one thread each; the difference in
    the time per decoded token, 0 or more. `hosts`: machine.rpc.RpcHost entries, asked already (the
    first only is measured); `done` is called after each run. Returns (seconds, the note, the runs)."""
    from moeplug.model.demo import ensure_demo_model

    demo, first = ensure_demo_model(progress), hosts[0].endpoint
    common = ["-p", "0", "-n", str(HOP_TOKENS), "-t", "1"]
    remote = _Bench(f"rpc hop: every layer on {first}'s first device", ["-rpc", first, "-dev", "RPC0", "-ngl", "99",
                                                                         *common])
    local = _Bench("rpc hop: every layer here", ["-ngl", "0", *common])
    for bench in (remote, local):
        try:
            _run_bench(build.binary("llama-bench"), demo, bench, HOP_TIMEOUT_S)
        except _BenchFailed as exc:
            raise MoeplugError(f"calibrate --rpc: the run '{bench.label}' failed: {exc}") from None
        if not bench.token_s:
            raise MoeplugError(f"calibrate --rpc: llama-bench reported no decode time in the run '{bench.label}'")
        if done:
            done()
    hop = max(0.0, remote.token_s - local.token_s)
    progress(Note(f"  remote hop: {hop * 1e6:.0f} us a token to {first}"))
    return hop, _hop_note(remote, local, hosts), [remote, local]


def _hop_note(remote: _Bench, local: _Bench, hosts: tuple[Any, ...]) -> str:
    """What the hop's figure is, with its numbers."""
    others = [h.endpoint for h in hosts[1:]]
    return (f"remote hop: {remote.token_s * 1e3:.3f} ms a token with every layer of the demo model on "
            f"{hosts[0].endpoint}'s first device against {local.token_s * 1e3:.3f} ms here, one thread each: one "
            f"round trip a token through llama.cpp's RPC path on a model whose compute is negligible (the remote "
            f"device's compute against this CPU's is left in); measured against the first host only"
            + (f", not {', '.join(others)}" if others else "")
            + ("; the remote run was no slower, so the hop is taken as 0" if remote.token_s <= local.token_s else ""))


def calibrate(build: Any, model: Path | None = None, threads: int | None = None,
              progress: ProgressFn = silent, rpc: tuple[Any, ...] = ()) -> Calibration:
    """Measure this machine's costs with `build` (a BuildResult: its llama-bench) on `model` (None: the
    demo model), at `threads` CPU threads (None: the physical cores this process may use, llama.cpp's
    default); with `rpc` (machine.rpc.RpcHost entries) the hop to the first too (measure_rpc_hop), every
    host asked first. Reports a Step per llama-bench run and a Note per result. Nothing is written."""
    if rpc:
        from moeplug.machine.rpc import remote_devices

        # every host asked for its devices before anything is made or measured: a one-line error for
        # one that does not answer or is no rpc-server
        remote_devices(build.binary("llama-server"), rpc)
    notes: list[str] = []
    methods: dict[str, str] = {}
    if model is None:
        from moeplug.model.demo import ensure_demo_model

        model = ensure_demo_model(progress)
        notes.append("measured on the demo model (tiny: what a token costs besides weights weighs more there "
                     "than on a real model, so the CPU's figure is low); 'moeplug calibrate MODEL' measures "
                     "with the model you serve")
    model = Path(model)
    info = inspect_model(model)
    if not info.layers:
        raise NotApplicableError(f"{model}: a dense model: no experts to calibrate with")
    threads = threads or usable_cores() or 1
    fingerprint, identity = machine_fingerprint(build.build_id)
    tool = build.binary("llama-bench")
    found = gpus()
    gpu_build = build.backend is Backend.CUDA  # its runs move experts with CUDA's pinned copies and NVML's memory
    use_gpu = bool(found) and gpu_build
    moved = _moved_blocks(info, found[0].free_bytes) if use_gpu else []
    dense_fits = use_gpu and found[0].free_bytes > info.non_expert_bytes + VRAM_HEADROOM
    total = 1 + (1 if found else 0) + (1 if dense_fits else 0) + (2 if dense_fits and moved else 0) + 2 * bool(rpc)
    done = 0
    runs: list[_Bench] = []

    def step() -> None:
        nonlocal done
        done += 1
        progress(Step(TASK, done, total, "run", every=0))

    progress(Note(f"calibrating with {model.name} ({len(info.layers)} MoE layers x {info.n_expert} experts, "
                  f"{info.n_expert_used} used), {threads} threads, build {build.build_id}"))
    progress(Step(TASK, 0, total, "run", every=0))
    t0 = time.monotonic()

    # --- the CPU: every weight on it, a few tokens decoded ---
    cpu = _Bench("cpu: every weight on the CPU, decode", ["-ngl", "0", "-p", "0", "-n", str(GEN_TOKENS),
                                                           "-t", str(threads)])
    try:
        _run_bench(tool, model, cpu)
    except _BenchFailed as exc:
        raise MoeplugError(f"calibrate: the CPU run failed: {exc}") from None
    runs.append(cpu)
    step()
    if cpu.token_s is None or cpu.token_s <= 0:
        raise MoeplugError("calibrate: llama-bench reported no decode time for the CPU run")
    expert_b, other_b = _per_token_bytes(info)
    cpu_rate = (expert_b + other_b) / cpu.token_s
    methods["cpu_expert_bytes_per_s"] = METHOD_CPU_RUN
    notes.append(f"CPU: {cpu.token_s * 1e3:.3f} ms a token with every weight on the CPU at {threads} threads, "
                 f"reading {human_bytes(expert_b)} of experts and {human_bytes(other_b)} of other weights; the "
                 f"other weights taken at the experts' rate (their {other_b / (expert_b + other_b):.0%} of the time "
                 f"left out); a token's costs besides weights are in the figure")
    progress(Note(f"  CPU: {cpu_rate / 1e9:.1f} GB/s of expert weights ({cpu.token_s * 1e3:.2f} ms a token)"))

    # --- the bus: pinned copies to GPU 0 ---
    h2d = None
    if found:
        from moeplug.machine.bus import h2d_bytes_per_s

        h2d, why = h2d_bytes_per_s([build.bin_dir])
        step()
        if h2d is None:
            notes.append(f"host-to-device rate not measured: {why}")
        else:
            methods["h2d_bytes_per_s"] = METHOD_PINNED
            progress(Note(f"  bus: {h2d / 1e9:.1f} GB/s host to device (pinned, 256 MiB copies)"))
    else:
        notes.append("no GPU: the bus is not measured (round trip, uploads and host-to-device rate are None)")

    # --- the GPU build: every layer's experts in RAM, then the last layers' in VRAM, then their down projections
    # alone back in RAM: the CPU's rate and the round trip each from what isolates it (_split_costs) ---
    round_trip = prompt_rate = None
    if found and not gpu_build:
        notes.append(f"a {build.backend.label} build: the round trip and the prompt uploads "
                     "need a CUDA build and are not measured")
    elif use_gpu and not dense_fits:
        notes.append(f"the weights beside the experts ({human_bytes(info.non_expert_bytes)}) do not fit in GPU 0's "
                     f"free memory with room to spare: the round trip and the prompt uploads are not measured")
    elif use_gpu:
        from moeplug.planner.estimates import choose_load_mode

        load_mode, _ = choose_load_mode(info, available_ram_bytes())
        lm = ["-lm", "none"] if load_mode == "pinned" else []
        common = ["-ngl", "999", "-p", str(PROMPT_BATCH), "-ub", str(PROMPT_BATCH), "-n", str(GEN_TOKENS),
                  "-t", str(threads), *lm]
        gpu_runs = [_Bench("gpu: every layer's experts in RAM", [*common, "-ncmoe", str(info.n_layer)])]
        if moved:
            gpu_runs += [_Bench(f"gpu: experts of the last {len(moved)} MoE layers in VRAM",
                                [*common, "-ncmoe", str(min(moved))]),
                         _Bench(f"gpu: the last {len(moved)} MoE layers' experts in VRAM but their down projections",
                                [*common, "-ncmoe", str(min(moved)), "-ot", _down_in_ram(moved)])]
        for bench in gpu_runs:
            try:
                runs.append(_run_bench(tool, model, bench))
            except _BenchFailed as exc:
                notes.append(f"the run '{bench.label}' failed ({exc}): the GPU's figures are not measured")
                break
            finally:
                step()
        all_ram = gpu_runs[0]
        if not moved and all_ram.token_s is not None:
            notes.append("no MoE layer's experts fit in GPU 0's free memory beside the other weights: the round "
                         "trip and the prompt uploads are not measured")
        if moved and all(b.token_s is not None for b in gpu_runs):
            split = _split_costs(info, moved, *(b.token_s for b in gpu_runs))
            notes.append(split.note)
            if split.cpu_rate is not None:
                cpu_rate, methods["cpu_expert_bytes_per_s"] = split.cpu_rate, split.method
                progress(Note(f"  CPU beside the GPU: {cpu_rate / 1e9:.1f} GB/s of expert weights"))
            if split.round_trip is not None:
                round_trip, methods["round_trip_s"] = split.round_trip, split.method
                progress(Note(f"  round trip: {round_trip * 1e6:.0f} us a layer"))
        if moved and all_ram.batch_s is not None and gpu_runs[1].batch_s is not None:
            fewer = gpu_runs[1]
            moved_all = sum(layer.expert_bytes for layer in info.layers if layer.block in moved)
            dt = all_ram.batch_s - fewer.batch_s
            if dt > 0 and h2d and moved_all / dt > 1.2 * h2d:
                # above what the bus carries: the batch did not upload every moved expert (run
                # 2026-12-05-user-machine-h200: 184 GB/s over a 55 GB/s bus), so this is no upload rate
                notes.append(f"prompt uploads not resolved: {human_bytes(moved_all)} more experts in RAM cost a "
                             f"{PROMPT_BATCH}-token batch {dt * 1e3:.2f} ms more, {moved_all / dt / 1e9:.0f} GB/s, "
                             f"above the bus's {h2d / 1e9:.0f} GB/s: the rate stays the bus-scaled default")
            elif dt > 0:
                prompt_rate = moved_all / dt
                methods["prompt_upload_bytes_per_s"] = METHOD_GPU_LAYERS
                notes.append(f"prompt uploads: a {PROMPT_BATCH}-token batch took {dt * 1e3:.2f} ms more with "
                             f"{human_bytes(moved_all)} more experts in RAM ({load_mode} memory, stock's path)")
                progress(Note(f"  prompt uploads: {prompt_rate / 1e9:.1f} GB/s"))
            else:
                notes.append("prompt uploads not resolved: the prompt batch was no slower with more experts in RAM")
    if found:
        notes.append("the GPU's rate on misses read from host memory is not measured (llama-bench has no way to "
                     "run that path): the planner keeps its fitted share")
    hop = None
    if rpc:
        hop, note, hop_runs = measure_rpc_hop(build, rpc, step, progress)
        methods["rpc_hop_s"] = METHOD_RPC_HOP
        notes.append(note)
        runs += hop_runs
    progress(Note(f"  measured in {time.monotonic() - t0:.0f} s"))

    return Calibration(fingerprint=fingerprint, cpu_expert_bytes_per_s=cpu_rate, round_trip_s=round_trip,
                       h2d_bytes_per_s=h2d, prompt_upload_bytes_per_s=prompt_rate, gpu_miss_bytes_per_s=None,
                       rpc_hop_s=hop, rpc=[rpc[0].endpoint] if rpc else [], measured_at=_now(), threads=threads,
                       build_id=build.build_id, model=str(model), machine=identity, notes=notes,
                       runs=[r.to_json() for r in runs], methods=methods)


def cost_model(cal: Calibration, source: str) -> CostModel:
    """The planner's cost model from a calibration (CostModel.from_measured: the rest the GPU machine's)."""
    return CostModel.from_measured(cal.cpu_expert_bytes_per_s, cal.h2d_bytes_per_s, cal.round_trip_s,
                                   cal.prompt_upload_bytes_per_s, cal.gpu_miss_bytes_per_s, cal.rpc_hop_s,
                                   source=source)


def measured_on_demo(cal: Calibration) -> bool:
    """Whether a calibration was measured on the demo model (or names no model): too small a model for
    the CPU's figure (a token's fixed costs outweigh its experts there)."""
    from moeplug.model.demo import demo_model_path

    return cal.model is None or Path(cal.model).name == demo_model_path().name


def remeasure_reason(cal: Calibration | None) -> str | None:
    """Why this machine's stored calibration is to be measured again with a real model before a plan
    trusts it (None: it stands): there is none, it was measured on the demo model, or by a moeplug that
    took the CPU's figure from the all-CPU run alone (a file without `methods`)."""
    if cal is None:
        return "this machine has no calibration yet"
    if measured_on_demo(cal):
        return "its calibration was measured on the demo model"
    if not cal.methods:
        return "its calibration was made by an older moeplug (the CPU's figure from the all-CPU run alone)"
    return None


def costs_for(build: Any, calibration: Path | None = None) -> CostModel:
    """The costs a plan on this machine uses: a calibration file given by hand, else this machine's
    own for the build (stored_calibration), else the GPU machine's fitted figures (DEFAULT_COSTS)."""
    if calibration is not None:
        return cost_model(read_calibration(calibration), f"the calibration file {calibration}")
    cal = stored_calibration(build) if build is not None else None
    if cal is None:
        return DEFAULT_COSTS
    return cost_model(cal, f"measured here ({cal.measured_at or 'date unknown'}, moeplug calibrate)")
