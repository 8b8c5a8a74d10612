"""Helpers the test modules share (imported as `helpers`; conftest.py holds only fixtures)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeplug.core.paths import builds_dir
from moeplug.model.synth import ModelSpec

# Small but real: 256-wide rows so every dtype, Q4_K included, applies to the expert tensors.
FIXTURE_SHAPE = dict(layers=3, experts=8, used=2, embd=256, expert_ff=256, heads=4, heads_kv=2, head_dim=64)


def fixture_spec(arch: str, dtype: str = "q8_0", seed: int = 7) -> ModelSpec:
    return ModelSpec(arch=arch, dtype=dtype, seed=seed, **FIXTURE_SHAPE)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> CliResult:
    """`moeplug ARGS` in this process, through moeplug.commands.main.main: the same parser, commands and error
    handling as the installed command, without a child process (what it prints is captured)."""
    from moeplug.commands.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def xdg_homes(root: Path, share_builds: bool = True) -> dict[str, str]:
    """This process's environment with fresh XDG data, state and config homes under root; the
    native builds (slow to make) shared through a link to the real builds folder."""
    import os

    from moeplug.core.paths import builds_dir

    builds = builds_dir()  # the real one, before the homes move
    env = dict(os.environ)
    for var in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        env[var] = str(root / var.lower())
    if share_builds:
        shared = Path(env["XDG_DATA_HOME"]) / "moeplug" / "builds"
        shared.parent.mkdir(parents=True)
        shared.symlink_to(builds)
    return env


def run_cli_process(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> CliResult:
    """The real `moeplug` command in a child process (end-to-end tests: servers that outlive it)."""
    r = subprocess.run([sys.executable, "-m", "moeplug", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    return CliResult(r.returncode, r.stdout, r.stderr)


# How the programs of a sanitized build (`moeplug native build --sanitize`) run in the tests: the
# first report stops the process with SIGABRT, so it can never pass for a refusal (exit 1).
# ubsan.supp names the upstream findings that are let through, each with its reason.
SANITIZER_ENV = {
    "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=1:detect_leaks=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:abort_on_error=1:"
                     f"suppressions={Path(__file__).with_name('ubsan.supp')}",
}
SANITIZER_REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")


@dataclass(frozen=True)
class Prebuilt:
    """A build's bin/ given by path (a build made elsewhere, e.g. a CUDA build on a GPU machine)."""

    bin_dir: Path
    manifest = {}  # type: ignore[var-annotated]

    def binary(self, name: str) -> Path:
        return self.bin_dir / name


def program_env(build) -> dict[str, str]:
    """The environment to run a program of `build` in: SANITIZER_ENV added for a sanitized build."""
    return {**os.environ, **(SANITIZER_ENV if build.manifest.get("sanitize") else {})}


def sanitizer_reports(text: str) -> list[str]:
    """The lines of a program's output that are sanitizer reports."""
    return [line for line in text.splitlines() if any(r in line for r in SANITIZER_REPORTS)]


def make_profile(build, model: Path, out: Path, n_predict: int, timeout: float = 600) -> Path:
    """A real profile of the model: llama-moe-profile of `build` on the bundled code prompts (under
    the sanitizers, and with no report, for a sanitized build)."""
    prompts = Path(__file__).parents[1] / "profiles" / "codeish.txt"
    r = subprocess.run([str(build.binary("llama-moe-profile")), "-m", str(model), "--prompts", str(prompts),
                        "--out", str(out), "-n", str(n_predict), "-t", "2"], capture_output=True, text=True,
                       timeout=timeout, env=program_env(build))
    assert r.returncode == 0, r.stderr[-2000:]
    assert not sanitizer_reports(r.stderr), r.stderr[-4000:]
    return out


def write_npz(path: Path, prompts: int = 12, seed: int = 3, layers: int = 24, experts: int = 32,
              used: int = 4, **override: np.ndarray) -> dict[str, np.ndarray]:
    """A routing trace in the npz layout of shared/data/traces (default: gpt-oss-20b's 24 layers x 4
    of 32): skewed, random, every expert id present, each token's ids distinct."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 40, size=prompts)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    skew = rng.dirichlet(np.full(experts, 0.5), size=layers)
    ex = np.stack([np.stack([rng.choice(experts, used, replace=False, p=skew[layer]) for layer in range(layers)])
                   for _ in range(n)]).astype(np.uint8)
    k = min(n, experts)  # layer 0 of the first tokens selects every expert id
    ex[:k, 0] = (np.arange(k)[:, None] + np.arange(used)) % experts
    probs = rng.random(ex.shape).astype(np.float16)
    arrays = {"experts": ex, "probs": probs, "offsets": offsets, **override}
    np.savez_compressed(path, **arrays)
    return arrays


XDG = ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")


def use_xdg_homes(mp: Any, root: Path) -> None:
    """xdg_homes for this process (mp: a pytest MonkeyPatch): moeplug's homes under root, the
    builds shared."""
    env = xdg_homes(root)
    for var in XDG:
        mp.setenv(var, env[var])


class XdgHome(dict):
    """Fresh XDG data/state/config homes under root sharing the built binaries (a link to the real
    builds folder), a llama-swap config folder and a router preset of the user's, and `moeplug` run
    in them. The object is the environment itself (a dict, for subprocess and helpers.moeplug), with
    the homes' folders as attributes."""

    def __init__(self, root: Path, share_builds: bool = True) -> None:
        super().__init__(xdg_homes(root, share_builds))
        self.root = root
        self.swap_dir = root / "llama-swap"
        self.swap_dir.mkdir(parents=True)
        self.preset = root / "router.ini"
        self.preset.write_text("; mine\n[*]\nc = 2048\n")
        self.data = Path(self["XDG_DATA_HOME"]) / "moeplug"
        self.state = Path(self["XDG_STATE_HOME"]) / "moeplug"

    @property
    def env(self) -> dict[str, str]:
        return self

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "moeplug", *args]

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def in_library(self, code: str) -> subprocess.CompletedProcess[str]:
        """Python code run against this home (the library reads the XDG variables)."""
        return subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)


# make_plan's request and machine facts from one flat set of keywords, as the planner's tests write them
MACHINE_KEYS = ("ram_available", "cpu_cores", "need", "draft_need", "expert_room", "backend", "pinned", "pinned_note",
                "device_env")


def plan_with(info: Any, ctx: int, budget: Any, profile_path: Path | None = None, *, profile: Any = None,
              **choices: Any) -> Any:
    """make_plan for a model at a context and budget: MACHINE_KEYS go to MachineFacts, the rest to PlanRequest."""
    from moeplug.planner.plan import make_plan
    from moeplug.planner.request import MachineFacts, PlanRequest

    machine = MachineFacts(**{k: choices.pop(k) for k in MACHINE_KEYS if k in choices})
    return make_plan(info, PlanRequest(ctx, budget, **choices), machine, profile, profile_path)


def layer_costs_of(info: Any, profile: Any, prefill_weight: float = 1.0, copy_ahead: bool = True) -> list:
    """The planner's per-layer cost curves for a model and profile at llama.cpp's prompt batch, one token a step."""
    from moeplug.planner.request import MachineFacts, PlanRequest
    from moeplug.planner.stages import layer_costs

    request = PlanRequest(0, prefill_weight=prefill_weight, ubatch=512)
    return layer_costs(info, profile, request, MachineFacts(), copy_ahead)


def moeplug(env: dict[str, str] | None, *args: str, timeout: float = 900) -> CliResult:
    """`moeplug ARGS` as a user runs it: the real command in a child process, in `env` (None: this
    process's environment)."""
    return run_cli_process(*args, env=env, timeout=timeout)


def one_line_error(r: Any, code: int | None, *words: str) -> str:
    """A refusal as the CLI promises it: exit `code` (None: any but 0), one line on stderr that starts
    'moeplug: error: ' and holds each of `words`, no traceback. Returns the line."""
    assert (r.returncode != 0 if code is None else r.returncode == code), (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeplug: error: "), r.stderr
    assert "Traceback" not in r.stderr and "--debug" not in lines[0], r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


class RpcServer:
    """A remote device for the tests: the build's ggml-rpc-server (llama.cpp's rpc-server, backed by
    this machine's CPU) on a loopback port, started, ended (SIGKILL: a host that drops), paused
    (SIGSTOP: a host that stops answering without closing) and resumed as a test asks."""

    def __init__(self, build: Any, log: Path | None = None) -> None:
        from moeplug.serving.server import free_port

        self.binary = build.binary("ggml-rpc-server")
        self.port = free_port()
        self.log = log  # where its output goes (appended), None: nowhere
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30) -> RpcServer:
        """Started (again, on the same port) unless it runs, and listening."""
        import socket
        import time

        if self.running():
            return self
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([str(self.binary), "-H", "127.0.0.1", "-p", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT)
        finally:
            if self.log:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while True:  # a connection closed at once: the rpc-server drops it and accepts the next
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, f"{self.binary} did not listen"
                time.sleep(0.1)

    def clients(self) -> int:
        """The clients it has accepted so far, as its log says (a connection that only checked the
        port counts too)."""
        return self.log.read_text(errors="replace").count("Accepted client connection") if self.log else 0

    def kill(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=30)

    def pause(self) -> None:
        assert self.proc is not None and self.running()
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.kill()
