"""Serving with remote devices (llama.cpp's RPC backend), for real: the demo installed with `--rpc`
over two rpc-servers of the patched build (its ggml-rpc-server, backed by this machine's CPU) and
served; what `moeplug status` and the dashboard show of its devices; and what they say when a host
drops mid-serve: ended while the server idles ("host lost": its connection closed), then a request
(llama.cpp aborts the server: "down", and why, from its log), or stopped without closing (the
server hangs on the next request: "unresponsive").

The module installs the demo once; each test serves it afresh with both hosts running, and stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import RpcServer, moeplug, xdg_homes

pytestmark = pytest.mark.native

BUDGET = 848 << 20  # what each remote device may hold: the demo's layers split over both
STATUS_S = 15.0  # `moeplug status` answers within this, whatever the servers do (its probes have timeouts)


@pytest.fixture(scope="module")
def remote(patched_build, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Fresh XDG homes (the builds shared) with the demo installed over two rpc-servers."""
    env = xdg_homes(tmp_path_factory.mktemp("rpc-serving"))
    hosts = [RpcServer(patched_build).start(), RpcServer(patched_build).start()]
    try:
        r = moeplug(env, "install", "demo", "--ctx", "1024", "--no-serve", "--json", "--rpc",
                    ",".join(h.endpoint for h in hosts), "--rpc-budget", f"{BUDGET >> 20}MiB,{BUDGET >> 20}MiB")
        assert r.returncode == 0, r.stderr[-3000:]
        yield {"env": env, "hosts": hosts, "plan": json.loads(r.stdout)["plan"]}
    finally:
        moeplug(env, "stop", "--all")
        for h in hosts:
            h.stop()


@pytest.fixture
def served(remote: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The demo served afresh, both its hosts running; stopped after the test."""
    env = remote["env"]
    for h in remote["hosts"]:
        h.resume()
        h.start()
    moeplug(env, "stop", "--all")
    r = moeplug(env, "serve", "demo", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        yield remote | {"server": status(env)["servers"][0]}
    finally:
        for h in remote["hosts"]:
            h.resume()
        moeplug(env, "stop", "--all")


def status(env: dict[str, str]) -> dict[str, Any]:
    """`moeplug status --json`, which answers in time and exits 0 whatever the servers' states."""
    start = time.monotonic()
    r = moeplug(env, "status", "--json")
    assert time.monotonic() - start < STATUS_S, "status took too long"
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def status_text(env: dict[str, str], columns: int | None = None) -> str:
    r = moeplug(env | ({"COLUMNS": str(columns)} if columns else {}), "status")
    assert r.returncode == 0, r.stderr
    return r.stdout


def dashboard(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, size: tuple[int, int] = (80, 24)) -> dict[str, Any]:
    """The dashboard on live snapshots at `size`, once it has shown one: the demo's row, the slots
    panel's summary, and whether every panel fits the screen."""
    from textual.widgets import DataTable, Static

    from moeplug.tui.app import make_app
    from moeplug.tui.screens.main import MainScreen

    for var in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(var, env[var])

    async def run() -> dict[str, Any]:
        app = make_app(interval=0)
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + 60
            while not isinstance(app.screen, MainScreen) or app.screen.refreshes < 1:
                assert time.monotonic() < deadline, "the dashboard showed no snapshot"
                await pilot.pause(0.05)
            screen = app.screen
            fits = all(screen.query_one(sel).region.right <= size[0] and screen.query_one(sel).region.bottom <= size[1]
                       for sel in ("#servers", "#slots", "#gpus", "#plan", "#activity"))
            return {"row": [str(c) for c in screen.query_one("#servers", DataTable).get_row("demo")],
                    "summary": str(screen.query_one("#slots-summary", Static).render()), "fits": fits}

    return asyncio.run(run())


def device_line(d: dict[str, Any]) -> str:
    """The dashboard's line for a device of status --json's `devices`."""
    blocks = d["blocks"]
    held = str(blocks[0]) if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
    return (f"{d['device']} {d['endpoint'] or 'this machine'}: blk {held}{' + output' if d['output'] else ''}, "
            f"{d['whole_layers']}/{d['moe_layers']} whole, {d['slots']} slots, 848.00 MiB")


def test_status_and_the_dashboard_show_each_device(served: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    env, hosts, plan = served["env"], served["hosts"], served["plan"]
    srv = status(env)["servers"][0]
    assert srv["state"] == "healthy" and srv["state_why"] is None and srv["hosts_closed"] == []
    devices = srv["devices"]
    # one per device of the plan, in llama.cpp's order, each where it is: here both remote
    assert [(d["device"], d["endpoint"], d["remote"]) for d in devices] == [
        ("RPC0", hosts[0].endpoint, True), ("RPC1", hosts[1].endpoint, True)]
    assert [(d["blocks"], d["whole_layers"], d["moe_layers"], d["slots"]) for d in devices] == [
        (d["blocks"], d["whole_layers"], d["moe_layers"], d["slots"]) for d in plan["devices"]]
    assert sorted(b for d in devices for b in d["blocks"]) == [0, 1, 2, 3] and devices[-1]["output"]
    assert [d["budget_bytes"] for d in devices] == [BUDGET, BUDGET]
    # the server runs on them: llama.cpp names each device and its host in the log
    log = Path(srv["log"]).read_text(errors="replace")
    for d in devices:
        assert f"using device {d['device']} ({d['endpoint']})" in log

    # a row per device in the text, within the terminal's columns where it is narrow
    text = status_text(env)
    rows = [re.split(r"\s{2,}", line) for line in text.splitlines()]
    assert ["model", "device", "where", "blocks", "whole layers", "slots", "budget"] in rows, text
    for d in devices:
        blocks = d["blocks"]
        held = (str(blocks[0]) if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}") + (" + output" if d["output"] else "")
        assert ["demo", d["device"], d["endpoint"], held, f"{d['whole_layers']} of {d['moe_layers']}", str(d["slots"]),
                "848.00 MiB"] in rows, text
    narrow = status_text(env, 60)
    part = narrow[narrow.index("device "):].splitlines()
    assert all(len(line) <= 60 for line in part), part
    for d in devices:
        assert f"demo {d['device']}  {d['endpoint']}; blocks" in narrow

    # the dashboard: a line per device in the slots panel, everything within 80x24
    shown = dashboard(env, monkeypatch)
    assert shown["row"][1] == "healthy" and shown["fits"]
    for d in devices:
        assert device_line(d) in shown["summary"].splitlines(), shown["summary"]


def test_a_host_that_ends_mid_serve_status_says_lost_then_down_and_why(served: dict[str, Any],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    env, hosts = served["env"], served["hosts"]
    url, dropped = served["server"]["url"], hosts[1]
    r = requests.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 4}, timeout=120)
    assert r.status_code == 200, r.text

    dropped.kill()  # while the server idles: nothing fails yet, but its connection to that host is closed
    deadline = time.monotonic() + 30
    while (srv := status(env)["servers"][0])["state"] != "host lost":
        assert time.monotonic() < deadline, srv
        time.sleep(0.2)
    assert srv["alive"] and srv["hosts_closed"] == [dropped.endpoint]
    assert srv["state_why"].startswith(f"{dropped.endpoint} closed its connection") and "next request" in srv["state_why"]

    # a request that needs it: llama.cpp ends the server, and the request ends with it (no hang)
    try:
        r = requests.post(f"{url}/completion", json={"prompt": "Hello again", "n_predict": 4}, timeout=120)
        assert r.status_code != 200, r.text
    except requests.ReadTimeout:
        pytest.fail("the request hung")
    except requests.ConnectionError:
        pass  # the connection dropped as the server ended
    deadline = time.monotonic() + 60
    while (srv := status(env)["servers"][0])["state"] != "down":
        assert time.monotonic() < deadline, srv
        time.sleep(0.5)
    # why, in one line: llama.cpp's abort message from the log, and the host that takes no connection now
    assert srv["state_why"].startswith(("Remote RPC server crashed or returned malformed response (ggml-rpc.cpp:",
                                          "send failed"))  # llama.cpp's line, as the abort raced the log, srv
    assert srv["hosts_not_answering"] == {dropped.endpoint: "does not answer (Connection refused)"}
    assert srv["state_why"].endswith(f"; now {dropped.endpoint} does not answer (Connection refused)")
    assert "\n" not in srv["state_why"]
    lines = status_text(env).splitlines()
    assert lines[2].split()[3] == "down" and f"demo: down: {srv['state_why']}" in lines

    shown = dashboard(env, monkeypatch)
    assert shown["row"][1] == "down" and shown["fits"]
    assert shown["summary"].splitlines()[0] == f"down: {srv['state_why']}"


def test_a_host_that_stops_answering_hangs_the_server_and_status_says_so(served: dict[str, Any]) -> None:
    """A host that stops answering without closing its connection (SIGSTOP here; a host cut off by
    the network does not close it either): llama.cpp waits on it, and /health still answers ok."""
    env, hosts = served["env"], served["hosts"]
    url, stalled = served["server"]["url"], hosts[1]
    stalled.pause()
    with pytest.raises(requests.ReadTimeout):  # llama.cpp neither answers nor ends: it hangs
        requests.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 4}, timeout=10)
    assert requests.get(f"{url}/health", timeout=5).json()["status"] == "ok"  # what a plain health check sees

    srv = status(env)["servers"][0]
    assert srv["alive"] and srv["state"] == "unresponsive", srv
    assert "answered no /slots in 2 s and used no CPU" in srv["state_why"]
    assert all(h.endpoint in srv["state_why"] for h in hosts)
    assert f"demo: unresponsive: {srv['state_why']}" in status_text(env).splitlines()

    stalled.resume()  # the host answers again: so does the server, and the request it held completes
    deadline = time.monotonic() + 60
    while (srv := status(env)["servers"][0])["state"] != "healthy":
        assert time.monotonic() < deadline, srv
        time.sleep(0.5)
    assert srv["state_why"] is None
    r = requests.post(f"{url}/completion", json={"prompt": "Hello", "n_predict": 4}, timeout=120)
    assert r.status_code == 200, r.text
