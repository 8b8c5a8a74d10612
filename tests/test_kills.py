"""Kills (issue 24, item 3): `moeplug` SIGKILLed at seeded random points of `profile`, `plan`,
`install` (the demo model present; with and without serving it) and the hook writes, as `kill -9
PID` does it (moeplug alone, not its children).

After every kill: each state file (installed records, server records, the hooks store, the
profile, the model, the hook files) is a complete version, old or new; no lock is held; no
child of the killed moeplug keeps running, except a launched llama-server, which `moeplug status`
shows ('unverified') and the next launch replaces; and the same command, run again, succeeds.
MOEPLUG_KILL_SEEDS (3) sets the kills per command.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import XdgHome

pytestmark = pytest.mark.native

SEEDS = range(1, 1 + int(os.environ.get("MOEPLUG_KILL_SEEDS", "3")))


@pytest.fixture(scope="module")
def demo_home(patched_build, tmp_path_factory: pytest.TempPathFactory) -> XdgHome:
    h = XdgHome(tmp_path_factory.mktemp("kills"))
    r = h.run("install", "demo", "--no-serve", "--ctx", "1024")
    assert r.returncode == 0, r.stderr[-3000:]
    for hook in (("llama-swap", "--config-dir", str(h.swap_dir)), ("llama-server", "--preset", str(h.preset))):
        r = h.run("hook", *hook)
        assert r.returncode == 0, r.stderr
    return h


CHECK_STATE = r"""
import json, sys
from pathlib import Path
from moeplug.serving.installed import list_installed, installed_dir
from moeplug.serving.launch import read_records, servers_dir
from moeplug.hooks.store import read_hooks, store_path
from moeplug.profile.format import read_profile
from moeplug.model.inspect import inspect_model
from moeplug.core.paths import data_dir
# every record parses completely (the readers skip damaged ones: count the files too)
assert len(list_installed()) == len(list(installed_dir().glob("*.json"))) == 1
records = read_records()
assert len(records) == len(list(servers_dir().glob("*.json"))) if servers_dir().exists() else True
assert len(read_hooks()) == 2 and json.loads(store_path().read_text())
for p in (data_dir() / "profiles").glob("*.gguf"):
    read_profile(p)
for p in (data_dir() / "models").glob("*.gguf"):
    inspect_model(p)
print(json.dumps([r.name for r in records]))
"""


def check_state(demo_home: XdgHome) -> None:
    r = demo_home.in_library(CHECK_STATE)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = yaml.safe_load((demo_home.swap_dir / "moeplug.yaml").read_text())
    assert list(doc["models"]) == ["demo"]
    preset = demo_home.preset.read_text()
    assert preset.startswith("; mine\n[*]\nc = 2048\n") and "; <<< moeplug demo" in preset
    for lock in (demo_home.state / "locks").glob("*.lock"):  # every lock free
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)


def children_of(demo_home: XdgHome, name: str) -> list[int]:
    """Processes running `name` (llama-moe-profile, llama-server) on this home's files."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if cmd and cmd[0].endswith(name.encode()) and demo_home.env["XDG_DATA_HOME"].encode() in b"\0".join(cmd) + environ:
            out.append(int(proc.name))
    return out


def wait_gone(demo_home: XdgHome, name: str, timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := children_of(demo_home, name)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_at(demo_home: XdgHome, args: tuple[str, ...], seconds: float) -> bool:
    """Run the command, SIGKILL it after `seconds`; True when it was still running then."""
    proc = subprocess.Popen(demo_home.argv(*args), env=demo_home.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def demo_model(demo_home: XdgHome) -> str:
    return json.loads(demo_home.run("list", "--json").stdout)["models"][0]["path"]


COMMANDS = {
    "profile": lambda h: ("profile", demo_model(h), "-n", "16", "--json"),
    "plan": lambda h: ("plan", "demo", "--json"),
    "install": lambda h: ("install", "demo", "--no-serve", "--ctx", "1024"),
    "hook llama-swap": lambda h: ("hook", "llama-swap", "--config-dir", str(h.swap_dir)),
    "hook llama-server": lambda h: ("hook", "llama-server", "--preset", str(h.preset)),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_killed_command_leaves_whole_state(demo_home: XdgHome, command: str) -> None:
    args = COMMANDS[command](demo_home)
    t0 = time.monotonic()
    r = demo_home.run(*args)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    killed = 0
    for seed in SEEDS:
        killed += kill_at(demo_home, args, random.Random(f"{command}{seed}").uniform(0.1, 1.0) * took)
        check_state(demo_home)
        assert wait_gone(demo_home, "llama-moe-profile") == []  # a profiler child dies with its moeplug
        r = demo_home.run(*args)
        assert r.returncode == 0, r.stderr[-2000:]
        check_state(demo_home)
    print(f"\nkills {command}: {killed} of {len(SEEDS)} killed mid-run (the run takes {took:.1f} s), state whole, "
          f"next run ok")
    assert killed >= 1


def test_killed_install_leaves_a_server_status_shows_and_the_next_launch_replaces(demo_home: XdgHome) -> None:
    args = ("install", "demo", "--ctx", "1024", "--json")
    t0 = time.monotonic()
    r = demo_home.run(*args)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    assert demo_home.run("stop", "demo").returncode == 0
    killed = 0
    try:
        for seed in SEEDS:
            killed += kill_at(demo_home, args, random.Random(f"serve{seed}").uniform(0.3, 1.0) * took)
            check_state(demo_home)
            servers = children_of(demo_home, "llama-server")
            status = json.loads(demo_home.run("status", "--json").stdout)["servers"]
            live = [s for s in status if s["alive"]]
            assert sorted(s["pid"] for s in live) == sorted(servers), (status, servers)  # no unknown server
            assert all(s["state"] in ("unverified", "healthy") for s in live), live
            r = demo_home.run(*args)  # replaces an unverified server, refuses a verified one
            if any(s["state"] == "healthy" for s in live):
                assert r.returncode == 1 and "already served" in r.stderr
            else:
                assert r.returncode == 0, r.stderr[-2000:]
            status = json.loads(demo_home.run("status", "--json").stdout)["servers"]
            assert [(s["name"], s["state"]) for s in status] == [("demo", "healthy")], status
            assert children_of(demo_home, "llama-server") == [status[0]["pid"]]
            assert demo_home.run("stop", "demo").returncode == 0
    finally:
        demo_home.run("stop", "--all")
    assert wait_gone(demo_home, "llama-server") == []
    print(f"\nkills install (serving): {killed} of {len(SEEDS)} killed mid-run (the run takes {took:.1f} s), "
          f"every server accounted for")
    assert killed >= 1
