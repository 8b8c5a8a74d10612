"""`moeplug rpc-server`: the patched build's ggml-rpc-server on a loopback port, asked for its device by
llama-server of the same build, stopped by a signal; the addresses and ports it refuses, in one line."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import moeplug, one_line_error, xdg_homes

from moeplug.machine.rpc import exposure, parse_rpc, remote_devices


def test_exposure_warns_beyond_loopback_and_private_networks() -> None:
    for quiet in ("127.0.0.1", "::1", "10.1.2.3", "192.168.0.7", "172.16.0.1"):
        assert exposure(quiet) is None, quiet
    assert "8.8.8.8" in (exposure("8.8.8.8") or "")
    # every address of the machine holds its public ones (Python's ipaddress counts 0.0.0.0 as private)
    for wildcard in ("0.0.0.0", "::"):
        assert "every address of this machine" in (exposure(wildcard) or ""), wildcard


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    """`moeplug rpc-server ARGS` in the background, as a user starts it."""
    return subprocess.Popen([sys.executable, "-m", "moeplug", "rpc-server", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_until(proc: subprocess.Popen[str], done, timeout: float = 120) -> str:
    """What it printed on stdout until done(text) holds (read from the pipe itself: select sees no
    text a buffered reader already holds); fails where it exits or is silent that long."""
    text, deadline, fd = "", time.monotonic() + timeout, proc.stdout.fileno()
    while not done(text):
        assert time.monotonic() < deadline, f"nothing in {timeout} s: {text!r}"
        if select.select([fd], [], [], 0.5)[0]:
            chunk = os.read(fd, 65536).decode()
            assert chunk, f"it exited ({proc.wait()}): {proc.stderr.read()}"
            text += chunk
    return text


def stop(proc: subprocess.Popen[str], signum: int) -> int:
    proc.send_signal(signum)
    try:
        return proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.native
def test_it_serves_its_device_to_llama_server_and_stops_on_sigterm(patched_build, tmp_path: Path) -> None:
    env, port = xdg_homes(tmp_path), free_port()
    proc = start(env, "--port", str(port), "--json")
    try:
        doc = json.loads(read_until(proc, lambda t: t.endswith("}\n")))
        assert doc["endpoint"] == f"127.0.0.1:{port}" and doc["use"] == f"moeplug install MODEL --rpc 127.0.0.1:{port}"
        assert doc["devices"] and doc["devices"][0]["total_bytes"] > 0, doc
        assert Path(doc["log"]).is_relative_to(env["XDG_STATE_HOME"])
        # llama-server of the same build, as the other machine runs it, lists what it serves
        devices = remote_devices(patched_build.binary("llama-server"), parse_rpc(f"127.0.0.1:{port}"))
        assert [(d.name, d.endpoint) for d in devices][:1] == [("RPC0", f"127.0.0.1:{port}")]
        assert devices[0].total_bytes == doc["devices"][0]["total_bytes"]
    finally:
        rc = stop(proc, signal.SIGTERM)
    assert rc == 0, proc.stderr.read()
    assert gone(doc["pid"]), "ggml-rpc-server outlived moeplug rpc-server"
    assert "Accepted client connection" in Path(doc["log"]).read_text()


@pytest.mark.native
def test_it_says_how_to_use_it_and_ctrl_c_stops_it(patched_build, tmp_path: Path) -> None:
    port = free_port()
    proc = start(xdg_homes(tmp_path), "--port", str(port), "--threads", "1")
    try:
        line = read_until(proc, lambda t: t.endswith("\n"))
    finally:
        rc = stop(proc, signal.SIGINT)
    assert rc == 0 and proc.stdout.read() == "", proc.stderr.read()
    assert line.startswith("serving ") and f"on 127.0.0.1:{port}" in line, line
    assert f"moeplug install MODEL --rpc 127.0.0.1:{port}" in line and "ssh -L" in line, line
    with pytest.raises(OSError):  # nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.native
def test_an_unknown_device_is_one_line(patched_build, tmp_path: Path) -> None:
    r = moeplug(xdg_homes(tmp_path), "rpc-server", "--port", str(free_port()), "--device", "NOSUCH0", timeout=120)
    one_line_error(r, 1, "--device NOSUCH0", "no such device", "available: ")


def test_a_port_in_use_is_one_line_before_it_starts(tmp_path: Path) -> None:
    env = xdg_homes(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = moeplug(env, "rpc-server", "--port", str(port), timeout=60)
        one_line_error(r, 1, f"port {port} on 127.0.0.1", "already in use", "--port")
        assert r.stdout == ""
        # every address: the warning first (it would reach beyond this machine), then the same refusal
        r = moeplug(env, "rpc-server", "--host", "0.0.0.0", "--port", str(port), timeout=60)
    warning, error = r.stderr.strip().splitlines()
    assert r.returncode == 1 and warning == exposure("0.0.0.0"), r.stderr
    assert error.startswith("moeplug: error: ") and f"port {port} on 0.0.0.0" in error, r.stderr
    assert not (Path(env["XDG_STATE_HOME"]) / "moeplug" / "logs").exists()  # nothing started


@pytest.mark.parametrize("host, code, words", [
    ("nowhere.example", 2, ["not an IPv4 address"]),
    ("::1", 2, ["not an IPv4 address"]),
    ("10.0.0.300", 2, ["not an IPv4 address"]),
    ("203.0.113.9", 1, ["--host 203.0.113.9", "not an address of this machine"]),  # TEST-NET-3
])
def test_a_bad_host_is_one_line(tmp_path: Path, host: str, code: int, words: list[str]) -> None:
    one_line_error(moeplug(xdg_homes(tmp_path), "rpc-server", "--host", host, timeout=60), code, *words)
