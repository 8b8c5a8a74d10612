"""Ports, disks, processes (issue 24, item 4): the port taken between moeplug's check and
llama-server's bind, the server dying while moeplug waits for its health and during the context
probe, a full disk while a profile is written, and a served model's file deleted under it. Each
time: one line naming the problem, a non-zero exit, nothing half-written, no server left behind,
and `moeplug status` telling the truth.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import XdgHome, one_line_error

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def demo_home(patched_build, tmp_path_factory: pytest.TempPathFactory) -> XdgHome:
    h = XdgHome(tmp_path_factory.mktemp("faults"))
    r = h.run("install", "demo", "--no-serve", "--ctx", "1024")
    assert r.returncode == 0, r.stderr[-3000:]
    return h


def servers(demo_home: XdgHome) -> list[dict]:
    r = demo_home.run("status", "--json")
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["servers"])


def server_pids(demo_home: XdgHome) -> list[int]:
    """llama-servers started from this home (its XDG folders are in their environment)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if cmd[0].endswith(b"llama-server") and demo_home.env["XDG_STATE_HOME"].encode() in env:
            out.append(int(proc.name))
    return out


def nothing_served(demo_home: XdgHome) -> None:
    assert servers(demo_home) == []
    deadline = time.monotonic() + 10
    while server_pids(demo_home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server_pids(demo_home) == []


def test_port_taken_between_check_and_bind(demo_home: XdgHome) -> None:
    """A socket bound but not listening passes moeplug's check (nothing answers there) and makes
    llama-server's bind fail: the race of another program taking the port in between."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        line = one_line_error(demo_home.run("serve", "demo", "--port", str(port)), None, f"port {port}", "was taken", "--port")
    print(f"\nport taken: {line}")
    nothing_served(demo_home)


def kill_server_when(demo_home: XdgHome, ready) -> tuple[subprocess.CompletedProcess[str], str]:
    """`moeplug serve demo` with its llama-server SIGKILLed as soon as ready(log text) holds."""
    proc = subprocess.Popen(demo_home.argv("serve", "demo"), env=demo_home.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = demo_home.state / "logs" / "server-demo.log"
    deadline = time.monotonic() + 60
    killed = ""
    while time.monotonic() < deadline and proc.poll() is None:
        pids = server_pids(demo_home)
        text = log.read_text(errors="replace") if log.exists() and pids else ""
        if pids and ready(text):
            os.kill(pids[0], signal.SIGKILL)
            killed = text.splitlines()[-1] if text.strip() else "(nothing logged yet)"
            break
        time.sleep(0.005)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), killed


def test_server_dies_during_the_health_wait(demo_home: XdgHome) -> None:
    r, when = kill_server_when(demo_home, lambda log: "server is listening" not in log)
    assert when, "the server was up before it could be killed"
    print(f"\nkilled while loading at: {when[-100:]}\n{one_line_error(r, None, 'llama-server was killed (signal 9) while loading')}")
    nothing_served(demo_home)


def test_server_dies_during_the_context_probe(demo_home: XdgHome) -> None:
    r, when = kill_server_when(demo_home, lambda log: "new prompt, n_ctx_slot" in log)
    assert when, "the probe was not seen in the log"
    print(f"\nkilled during the probe at: {when[-100:]}\n{one_line_error(r, None, 'context probe')}")
    nothing_served(demo_home)


@contextlib.contextmanager
def small_filesystem(where: Path, size_kib: int) -> Iterator[tuple[Path, str]]:
    """A tmpfs of size_kib mounted at `where` (root), else `where` as it is (the caller limits the
    writer's file size instead)."""
    where.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)], capture_output=True).returncode == 0
    try:
        yield where, "tmpfs" if mounted else "RLIMIT_FSIZE"
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=True)


def test_full_disk_while_writing_a_profile(demo_home: XdgHome, tmp_path: Path) -> None:
    """`moeplug profile merge` of the demo's profile onto a small file system that holds the old
    profile (a smaller one) but not the new: one line naming the file, the old profile intact, no
    temporary file left."""
    profile = Path(json.loads(demo_home.run("list", "--json").stdout)["models"][0]["profile"])
    size = profile.stat().st_size
    with small_filesystem(tmp_path / "small", size_kib=(size + size // 2) // 1024) as (small, how):
        old = small / "demo.profile.gguf"
        old.write_bytes(b"an old profile")  # small: the merged one does not fit beside it... or at all
        limit = size // 2
        preexec = None
        if how == "RLIMIT_FSIZE":
            def preexec() -> None:  # Python ignores SIGXFSZ: the write fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        else:  # fill the file system but for half a profile
            filler = small / "filler"
            free = shutil.disk_usage(small).free
            filler.write_bytes(b"\0" * max(free - limit, 0))
        r = subprocess.run([sys.executable, "-m", "moeplug", "profile", "merge", "--force", str(old), str(profile), str(profile)],
                           env=demo_home.env, capture_output=True, text=True, timeout=120, preexec_fn=preexec)
        line = one_line_error(r, None, str(old), "cannot write it", "left as it was")
        assert old.read_bytes() == b"an old profile"
        assert sorted(p.name for p in small.iterdir() if p.name != "filler") == ["demo.profile.gguf"]
    print(f"\nfull disk ({how}): {line}")


def test_model_deleted_while_served(demo_home: XdgHome, tmp_path: Path) -> None:
    """A model installed from a path, served, its file deleted: it keeps serving, status says the
    file is gone, and serving it again is one line naming the file."""
    demo = Path(json.loads(demo_home.run("list", "--json").stdout)["models"][0]["path"])
    model = tmp_path / "doomed.gguf"
    shutil.copyfile(demo, model)
    r = demo_home.run("install", str(model), "--ctx", "1024", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        model.unlink()
        (status,) = servers(demo_home)
        assert (status["name"], status["state"], status["model_present"]) == ("doomed", "healthy", False)
        text = demo_home.run("status").stdout
        assert "healthy, model file gone" in text
        assert demo_home.run("stop", "doomed").returncode == 0
        line = one_line_error(demo_home.run("serve", "doomed"), None, str(model), "no such model file")
        print(f"\nmodel deleted: {line}")
    finally:
        demo_home.run("stop", "--all")
    nothing_served(demo_home)
