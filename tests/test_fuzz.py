"""Hostile files (issue 24, item 2): mutated GGUF models and profiles (tests/gguf_mutate.py: bit
flips, truncation at every header field, huge and negative counts, wrong type codes), fed to
`moeplug inspect` and `moeplug profile analyze` in this process (thousands of cases) and to the
real llama-server, patched and stock (a bounded number: each is a process start).

moeplug must answer every case with its result or one line naming the problem ('moeplug: error:
...', exit 1 or 3), never an unexpected exception; llama-server must never die of a signal, must
say `moe-cache: not engaged, ...` once for a profile it cannot use (or engage on a mutant that is
still a valid profile of the model) and keep serving, and must refuse a broken model exactly when
stock refuses it. The native tests run twice: on the patched build, and on the same patches built
under AddressSanitizer and UndefinedBehaviorSanitizer (`moeplug native build --sanitize`, the
`sanitized_build` fixture), where the first report stops the server and fails the case
(helpers.SANITIZER_ENV). Each test stops at its time limit and prints how many cases it ran.

MOEPLUG_FUZZ_CASES (random mutants per in-process test, 2000), MOEPLUG_FUZZ_NATIVE_CASES (server
starts per native test, 150) and MOEPLUG_FUZZ_SANITIZED_CASES (the same under the sanitizers, 200)
scale them.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from gguf_mutate import mutants, truncations
from helpers import make_profile, program_env, run_cli, sanitizer_reports
from moeplug.serving.server import free_port, server_argv
from moeplug.model.synth import ModelSpec, make_model

CASES = int(os.environ.get("MOEPLUG_FUZZ_CASES", "1000"))  # mutants (and every truncation) a CLI fuzz test runs
NATIVE_CASES = int(os.environ.get("MOEPLUG_FUZZ_NATIVE_CASES", "150"))
SANITIZED_CASES = int(os.environ.get("MOEPLUG_FUZZ_SANITIZED_CASES", "200"))
TIME_LIMIT_S = 60  # per test
SEEDS = (1, 2)
TINY = ModelSpec(arch="qwen3moe", layers=2, experts=4, used=2, embd=64, expert_ff=64, heads=2, heads_kv=1,
                 head_dim=32, dtype="f32", seed=5)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(TINY, tmp_path_factory.mktemp("fuzz") / "tiny.gguf")[0]


@pytest.fixture(scope="module")
def tiny_profile(tiny_model: Path, patched_build) -> Path:
    return make_profile(patched_build, tiny_model, tiny_model.with_name("tiny.profile.gguf"), 4)


@pytest.mark.native
def test_profiler_runs_clean_under_the_sanitizers(sanitized_build, tiny_model: Path, tmp_path: Path) -> None:
    """The sanitized llama-moe-profile writes a profile of the tiny model that moeplug reads, with no
    ASan or UBSan report (make_profile checks its output)."""
    out = make_profile(sanitized_build, tiny_model, tmp_path / "asan.profile.gguf", 4)
    r = run_cli("profile", "analyze", "--slots", "1,2", "--json", str(out))
    assert r.returncode == 0, r.stderr


def cases(data: bytes, n: int, data_too: bool) -> list[tuple[str, bytes]]:
    """Every truncation and n mutants split over the seeds, taken in turn, so that a loop the time
    limit cuts short (a loaded machine) still runs both kinds."""
    trunc = list(truncations(data))
    mutated: list[tuple[str, bytes]] = []
    for seed in SEEDS:
        mutated += mutants(data, random.Random(seed), n // len(SEEDS), data_too)
    out = [case for pair in zip(trunc, mutated) for case in pair]
    common = min(len(trunc), len(mutated))
    return out + trunc[common:] + mutated[common:]


def check_one_line_error(r, case: str) -> None:
    assert r.returncode in (0, 1, 3), (case, r.returncode, r.stderr)
    if r.returncode:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moeplug: error: "), (case, r.stderr)
        assert "--debug" not in lines[0], (case, lines[0])  # an unexpected exception, not a named problem
    assert "Traceback" not in r.stderr + r.stdout, case


def within(cases: list, seconds: float):
    """The cases in order, until seconds have passed (the fuzz loops are bounded in time)."""
    deadline = time.monotonic() + seconds
    for case in cases:
        if time.monotonic() > deadline:
            return
        yield case


def fuzz_cli(data: bytes, path: Path, argv: list[str], data_too: bool, what: str) -> None:
    path.write_bytes(data)
    assert run_cli(*argv, str(path)).returncode == 0  # the file itself is read
    ran = refused = 0
    all_cases = cases(data, CASES, data_too)
    for case, buf in within(all_cases, TIME_LIMIT_S):
        path.write_bytes(buf)
        r = run_cli(*argv, str(path))
        check_one_line_error(r, case)
        ran += 1
        refused += r.returncode != 0
    print(f"\nfuzz {what}: {ran} of {len(all_cases)} cases in the time limit, {refused} refused in one line, "
          f"{ran - refused} read, 0 tracebacks")
    assert ran >= min(len(all_cases), 1000)
    assert 0 < refused < ran  # some mutants are still valid files, most are not


def test_inspect_answers_hostile_headers_in_one_line(tiny_model: Path, tmp_path: Path) -> None:
    fuzz_cli(tiny_model.read_bytes(), tmp_path / "case.gguf", ["inspect", "--json"], False, "moeplug inspect")


@pytest.mark.native
def test_profile_reader_answers_hostile_profiles_in_one_line(tiny_profile: Path, tmp_path: Path) -> None:
    fuzz_cli(tiny_profile.read_bytes(), tmp_path / "case.gguf", ["profile", "analyze", "--slots", "1,2", "--json"],
             True, "moeplug profile analyze")


def test_header_walk_is_fast_on_huge_counts(tiny_model: Path, tmp_path: Path) -> None:
    """A string array that claims 2**32 - 1 items: refused at once (the reader took 95 s on it)."""
    from gguf_mutate import layout, put_u64

    data = bytearray(tiny_model.read_bytes())
    lay = layout(bytes(data))
    path = tmp_path / "huge.gguf"
    for at in lay.counts:
        put_u64(data, at, 2**32 - 1)
        path.write_bytes(data)
        t0 = time.monotonic()
        r = run_cli("inspect", str(path))
        assert time.monotonic() - t0 < 2, at
        check_one_line_error(r, f"u64@{at}")
        data[at:at + 8] = tiny_model.read_bytes()[at:at + 8]


# ---------------------------------------------------------------------------------------------
# the native server: the patched build, and the same patches under ASan and UBSan


@dataclass
class Server:
    """The llama-server the native tests run: its binary, the environment (the sanitizers'
    options for the sanitized build), and how many cases each test may run in how long."""
    what: str
    binary: Path
    env: dict[str, str]
    profile_cases: int
    profile_s: float
    model_cases: int  # random mutants, after 10 truncations
    model_s: float


@pytest.fixture(params=["patched", "sanitized"])
def server(request) -> Server:
    """The patched build, and the same patches under ASan and UBSan (fewer cases: each start is
    slower; together the two sanitized tests stay under 5 minutes on 2 cores)."""
    build = request.getfixturevalue(f"{request.param}_build")
    env = {**program_env(build), "LLAMA_MOE_CACHE_DEVICE": "CPU"}
    binary = build.binary("llama-server")
    if request.param == "patched":
        return Server("llama-server", binary, env, NATIVE_CASES, 2 * TIME_LIMIT_S, max(NATIVE_CASES // 5, 10),
                      TIME_LIMIT_S)
    return Server("llama-server (ASan+UBSan)", binary, env, SANITIZED_CASES, 3 * TIME_LIMIT_S,
                  max(SANITIZED_CASES // 4, 10), 1.5 * TIME_LIMIT_S)


LOAD_S = 20


def start(binary: Path, model: Path, extra: list[str], log: Path,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen(server_argv(binary, model, port, ["-t", "1", "-c", "256", *extra]), stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env or {**os.environ, "LLAMA_MOE_CACHE_DEVICE": "CPU"})
    return proc, port


def outcome(proc: subprocess.Popen[bytes], port: int) -> str:
    """'serving' (healthy, answered a 2-token request), 'refused' (exited with an error code) or
    'signal N'; the process is gone when this returns."""
    deadline = time.monotonic() + LOAD_S
    try:
        while time.monotonic() < deadline:
            rc = proc.poll()
            if rc is not None:
                return f"signal {-rc}" if rc < 0 else "refused"
            try:
                h = requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if h.status_code == 200:
                    r = requests.post(f"http://127.0.0.1:{port}/completion", timeout=LOAD_S,
                                      json={"prompt": "def main", "n_predict": 2, "temperature": 0})
                    if r.status_code != 200:
                        return f"HTTP {r.status_code}"
                    rc = proc.poll()
                    return "serving" if rc is None else f"died after a request ({rc})"
            except requests.RequestException:
                pass
            time.sleep(0.02)
        return "no answer in time"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def no_sanitizer_report(log: Path, case: str) -> str:
    text = log.read_text(errors="replace")
    assert not sanitizer_reports(text), (case, text[-6000:])
    return text


@pytest.mark.native
def test_llama_server_serves_on_hostile_profiles(server: Server, tiny_model: Path, tiny_profile: Path,
                                                 tmp_path: Path) -> None:
    """The profile itself, truncations at every header field, then random mutants of the whole
    profile (its counts too): the server starts, says once why the cache is not engaged (or
    engages it) and answers; under the sanitizers, without a report."""
    data = tiny_profile.read_bytes()
    trunc = list(truncations(data))
    rng = random.Random(SEEDS[0])
    picked = [("the profile", data)] + rng.sample(trunc, min(len(trunc), server.profile_cases // 3))
    picked += list(mutants(data, rng, server.profile_cases - len(picked), data_too=True))
    profile, log = tmp_path / "case.gguf", tmp_path / "server.log"
    seen: dict[str, int] = {}
    ran = 0
    for case, buf in within(picked, server.profile_s):
        profile.write_bytes(buf)
        got = outcome(*start(server.binary, tiny_model, ["--moe-cache-profile", str(profile),
                                                         "--moe-cache-slots", "2"], log, server.env))
        text = no_sanitizer_report(log, case)
        lines = [ln for ln in text.splitlines() if "moe-cache: " in ln]
        assert got == "serving", (case, got, text[-3000:])
        assert len(lines) == 1 and ("moe-cache: not engaged, running without it: " in lines[0]
                                    or " slots, " in lines[0]), (case, lines)
        kind = "engaged" if "not engaged" not in lines[0] else "not engaged"
        seen[kind] = seen.get(kind, 0) + 1
        ran += 1
    print(f"\nfuzz {server.what} --moe-cache-profile: {ran} of {len(picked)} cases in the time limit, "
          f"0 crashes, 0 sanitizer reports; {seen}")
    assert ran >= min(len(picked), 50)
    assert seen.get("engaged", 0) >= 1  # the profile itself at least: the cache's code ran


@pytest.mark.native
def test_llama_server_refuses_broken_models_as_stock_does(server: Server, stock_build, tiny_model: Path,
                                                         tiny_profile: Path, tmp_path: Path) -> None:
    """Mutated model headers: the patched server (with the cache asked for) refuses, serves or
    fails exactly as stock does, never dies of a signal where stock does not, and under the
    sanitizers makes no report."""
    data = tiny_model.read_bytes()
    rng = random.Random(SEEDS[1])
    trunc = list(truncations(data))
    picked = rng.sample(trunc, 10) + list(mutants(data, rng, server.model_cases, data_too=False))
    model, log = tmp_path / "case.gguf", tmp_path / "server.log"
    outcomes: dict[str, int] = {}
    ran = 0
    for case, buf in within(picked, server.model_s):
        model.write_bytes(buf)
        stock = outcome(*start(stock_build.binary("llama-server"), model, [], log))
        mine = outcome(*start(server.binary, model, ["--moe-cache-profile", str(tiny_profile),
                                                     "--moe-cache-slots", "2"], log, server.env))
        text = no_sanitizer_report(log, case)
        assert mine == stock or (stock.startswith("signal") and mine == "refused"), (case, mine, stock, text[-2000:])
        outcomes[stock] = outcomes.get(stock, 0) + 1
        ran += 1
    print(f"\nfuzz model headers, {server.what} vs stock llama-server: {ran} of {len(picked)} cases in the "
          f"time limit, outcomes as stock's, 0 sanitizer reports: {outcomes}")
    assert ran >= min(len(picked), 20)
