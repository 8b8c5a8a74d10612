"""The dashboard against a real served demo (CPU build, slots in RAM): what it shows is what
`moeplug status --json` says, its stop and start really stop and start llama-server, and a
server killed behind its back turns "down"."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from textual.pilot import Pilot
from textual.widgets import DataTable, Label, Log, ProgressBar, Static

from moeplug.machine.gpu import gpus
from moeplug.serving.monitor import parse_server_metrics
from moeplug.tui.app import make_app
from moeplug.tui.widgets.activity import ActivityBar
from moeplug.tui.format import percent
from moeplug.tui.screens.main import MainScreen
from helpers import XDG, XdgHome, moeplug

pytestmark = pytest.mark.native
INTERVAL = 0.5


@pytest.fixture(scope="module")
def demo_home(patched_build, tmp_path_factory: pytest.TempPathFactory) -> Iterator[XdgHome]:
    """Fresh XDG homes sharing the built binaries, set in this process too (the app runs here),
    with the demo installed and served as a user gets it (the hit counters and recording on by default)."""
    h = XdgHome(tmp_path_factory.mktemp("tui-home"))
    with pytest.MonkeyPatch.context() as mp:
        for var in XDG:
            mp.setenv(var, h[var])
        r = moeplug(h, "install", "demo", "--ctx", "1024", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        try:
            yield h
        finally:
            moeplug(h, "stop", "--all")


def status(env: dict[str, str]) -> dict[str, Any]:
    r = moeplug(env, "status", "--json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def served(env: dict[str, str]) -> dict[str, Any]:
    """The demo's status entry, serving it again first when an earlier test stopped it."""
    servers = status(env)["servers"]
    if not servers or not servers[0]["alive"]:
        moeplug(env, "stop", "--all")
        r = moeplug(env, "serve", "demo", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        servers = status(env)["servers"]
    return dict(servers[0])


def gone(pid: int) -> bool:
    """The process has exited (a zombie still waiting for its parent counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


def run_app(test: Callable[[Pilot[None], MainScreen], Awaitable[None]], size: tuple[int, int] = (100, 30)) -> None:
    async def main() -> None:
        app = make_app(interval=INTERVAL)
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: isinstance(app.screen, MainScreen) and app.screen.refreshes >= 1)
            await test(pilot, app.screen)  # type: ignore[arg-type]

    asyncio.run(main())


async def until(pilot: Pilot[None], cond: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def cells(screen: MainScreen, table: str, key: str) -> list[str]:
    return [str(c) for c in screen.query_one(table, DataTable).get_row(key)]


def activity(screen: MainScreen) -> str:
    return str(screen.query_one("#activity-text", Label).render())


def test_healthy_row_and_slots_as_status_says(demo_home: dict[str, str]) -> None:
    srv = served(demo_home)

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        row = cells(screen, "#servers", "demo")
        assert row[0] == "demo" and row[1] == "healthy" and row[-1] == srv["url"]
        assert row[7] == "4x8 on CPU"  # the cache line: 4 layers x 8 slots, in RAM
        doc = status(demo_home)["servers"][0]  # nothing ran since the app's snapshot: same counters
        # the launch's context probe (a full 1024-token context of one token) is not the users' traffic: not counted
        assert doc["metrics"]["prompt_tokens"] == 0 and doc["cache_counters"]["selections"] == 0
        assert row[6] == f"{doc['ctx_used']}/{doc['n_ctx']}" and doc["n_ctx"] > 0
        assert [layer["block"] for layer in doc["layers"]] == [0, 1, 2, 3]
        for layer in doc["layers"]:
            assert layer["slots"] == 8 and layer["n_expert"] == 32 and layer["kind"] == "partial"
            assert layer["selections"] == 0 and layer["predicted_hit_rate"] is not None
            assert cells(screen, "#layers", str(layer["block"])) == [
                str(layer["block"]), "8/32", "partly", percent(layer["predicted_hit_rate"]),
                percent(layer["measured_hit_rate"])]
        summary = str(screen.query_one("#slots-summary", Static).render())
        assert f"meas {percent(doc['cache_counters']['hit_rate'])}" in summary

        # a request: the row shows its decode throughput within two refreshes, as its counters say
        before = parse_server_metrics(requests.get(f"{srv['url']}/metrics", timeout=5).text)
        r = requests.post(f"{srv['url']}/completion", json={"prompt": "def main():", "n_predict": 24,
                                                              "temperature": 0, "cache_prompt": False}, timeout=120)
        assert r.status_code == 200
        after = parse_server_metrics(requests.get(f"{srv['url']}/metrics", timeout=5).text)
        assert before and after and after.decode_tokens - before.decode_tokens == 24
        assert after.requests_processing == 0
        shown = screen.refreshes
        await until(pilot, lambda: screen.refreshes >= shown + 2)
        assert float(cells(screen, "#servers", "demo")[4]) > 0
        # that request is what the counters hold now: the measured hit rate is the users' traffic's
        doc = status(demo_home)["servers"][0]
        assert all(layer["selections"] > 0 for layer in doc["layers"]) and doc["metrics"]["decode_tokens"] == 24
        await until(pilot, lambda: f"meas {percent(doc['cache_counters']['hit_rate'])}" in
                    str(screen.query_one("#slots-summary", Static).render()))

    run_app(check)


def served_afresh(demo_home: dict[str, str], *flags: str) -> dict[str, Any]:
    """The demo served anew (with `flags`): a server that has answered nothing but its start-up check."""
    moeplug(demo_home, "stop", "--all")
    r = moeplug(demo_home, "serve", "demo", *flags, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(status(demo_home)["servers"][0])


def whole_cells(screen: MainScreen) -> None:
    """Every cell of the servers table fits its column (DataTable cuts what does not)."""
    table = screen.query_one("#servers", DataTable)
    for key, column in table.columns.items():
        width = column.get_render_width(table) - 2 * table.cell_padding
        for row in table.rows:
            value = str(table.get_cell(row, key))
            assert len(value) <= width, (str(key.value), value, width)


@pytest.mark.parametrize("size", [(80, 24), (160, 45)])
def test_a_fresh_server_row_whole_and_without_the_start_up_check(demo_home: dict[str, str],
                                                                 size: tuple[int, int]) -> None:
    """At 80x24 and 160x45: right after a start the row shows no decode rate (the start-up check's
    one-token request is not one: it used to read 100000) and no measured hit rate; cells that grow
    (uptime "9s" -> "1h02m", a throughput) stay whole; the context cell shows both numbers."""
    srv = served_afresh(demo_home)
    record_file = Path(demo_home["XDG_STATE_HOME"]) / "moeplug" / "servers" / "demo.json"

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        row = cells(screen, "#servers", "demo")
        assert row[1] == "healthy" and row[3] == "-" and row[4] == "-", row
        assert row[6] == f"{srv['ctx_used']}/{srv['n_ctx']}" and srv["ctx_used"] > 1000  # the check's context
        assert "meas -" in str(screen.query_one("#slots-summary", Static).render())
        whole_cells(screen)
        # the server has been up an hour: its record says it started then (what `moeplug status` reads too)
        doc = json.loads(record_file.read_text())
        record_file.write_text(json.dumps(doc | {"started": doc["started"] - 3720}))
        await until(pilot, lambda: cells(screen, "#servers", "demo")[2].startswith("1h0"))
        r = requests.post(f"{srv['url']}/completion", json={"prompt": "def main():", "n_predict": 16,
                                                              "temperature": 0, "cache_prompt": False}, timeout=120)
        assert r.status_code == 200
        await until(pilot, lambda: cells(screen, "#servers", "demo")[4] != "-")
        whole_cells(screen)
        shot = pilot.app.export_screenshot()
        for cell in cells(screen, "#servers", "demo")[:7]:  # name to ctx: on screen at 80 columns too
            assert cell.replace(" ", "&#160;") in shot, cell
        if size[0] >= 160:
            assert srv["url"] in shot  # the whole row

    run_app(check, size)


def test_start_offers_to_restart_a_model_served_without_counters(demo_home: dict[str, str]) -> None:
    """`s` on a model served --no-metrics: a restart with the hit counters, on its port; `s` again: it
    says the model is served already."""
    srv = served_afresh(demo_home, "--no-metrics")
    assert "--metrics" not in srv["args"] and srv["cache_counters"] is None

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        summary = str(screen.query_one("#slots-summary", Static).render())
        assert "served --no-metrics; s restarts it with counters" in summary, summary
        await pilot.press("s")
        await until(pilot, lambda: pilot.app.screen is not screen)
        question = str(pilot.app.screen.query_one(Label).render())
        assert question == "demo runs without the hit counters: restart it with them?", question
        await pilot.press("y")
        await until(pilot, lambda: activity(screen).startswith(("demo serving at", "error:")), timeout=300)
        assert activity(screen) == f"demo serving at {srv['url']} with the hit counters", activity(screen)
        # the dashboard's next snapshot has the new server (its counters: no "served --no-metrics" line; "meas -"
        # shows before it as well), so `s` finds it served with them
        await until(pilot, lambda: "served --no-metrics" not in str(screen.query_one("#slots-summary", Static).render()))
        await pilot.press("s")
        await until(pilot, lambda: activity(screen).startswith("demo is already served"))

    run_app(check)
    now = status(demo_home)["servers"][0]
    assert now["pid"] != srv["pid"] and now["port"] == srv["port"] and "--metrics" in now["args"]
    assert now["cache_counters"]["selections"] == 0  # the restart's start-up check not counted either


def test_no_gpu_shown_as_such(demo_home: dict[str, str]) -> None:
    served(demo_home)
    found = gpus()

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        text = str(screen.query_one("#gpus", Static).render())
        if not found:
            assert text.startswith("no GPU: slots in RAM") and "GiB" not in text
        else:
            assert all(g.name[:30] in text for g in found)

    run_app(check)


def test_stop_from_the_ui_stops_the_server(demo_home: dict[str, str]) -> None:
    srv = served(demo_home)

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        await pilot.press("x")
        await pilot.pause(0.1)
        await pilot.press("y")
        await until(pilot, lambda: activity(screen) == "demo stopped")
        await until(pilot, lambda: cells(screen, "#servers", "demo")[1] == "stopped")

    run_app(check)
    assert gone(srv["pid"])
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{srv['url']}/health", timeout=2)
    assert status(demo_home)["servers"] == []


def test_start_from_the_ui_then_a_killed_server_turns_down(demo_home: dict[str, str]) -> None:
    moeplug(demo_home, "stop", "--all")

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        assert cells(screen, "#servers", "demo")[1] == "stopped"
        await pilot.press("s")
        await pilot.pause(0.1)
        await pilot.press("y")
        await until(pilot, lambda: activity(screen).startswith("demo serving at"), timeout=300)
        await until(pilot, lambda: cells(screen, "#servers", "demo")[1] == "healthy")
        pid = status(demo_home)["servers"][0]["pid"]
        assert requests.get(f"{status(demo_home)['servers'][0]['url']}/health", timeout=5).json()["status"] == "ok"
        os.kill(pid, signal.SIGKILL)
        killed_at = screen.refreshes
        await until(pilot, lambda: cells(screen, "#servers", "demo")[1] == "down", timeout=30)
        assert screen.refreshes <= killed_at + 2

    run_app(check)
    assert [(s["name"], s["alive"], s["state"]) for s in status(demo_home)["servers"]] == [("demo", False, "down")]


def test_log_replan_and_reprofile_from_the_ui(demo_home: dict[str, str]) -> None:
    srv = served(demo_home)
    profile = Path(json.loads(moeplug(demo_home, "list", "--json").stdout)["models"][0]["profile"])
    made = profile.stat().st_mtime_ns
    expected = json.loads(moeplug(demo_home, "plan", "demo", "--vram-budget", "1GiB", "--ctx", "1024", "--json").stdout)

    async def check(pilot: Pilot[None], screen: MainScreen) -> None:
        # l: the server's log at its tail, the moe-cache line in it
        await pilot.press("l")
        await until(pilot, lambda: any("moe-cache:" in line for line in pilot.app.screen.query_one(Log).lines))
        await pilot.press("escape")
        await until(pilot, lambda: pilot.app.screen is screen)

        # p: the plan `moeplug plan` makes for a budget typed in; ctrl+r restarts with it
        await pilot.press("p")
        await pilot.pause(0.1)
        await pilot.press(*"1GiB", "enter")
        shown = lambda: str(pilot.app.screen.query_one("#plan", Static).render())  # noqa: E731
        await until(pilot, lambda: shown().startswith("budget 1.00 GiB"))
        assert f"args {shlex.join(expected['server_args'])}" in shown()
        await pilot.press("ctrl+r")
        await until(pilot, lambda: activity(screen).startswith(("demo serving at", "error:")), timeout=300)
        assert activity(screen).endswith("with the new plan"), activity(screen)
        await until(pilot, lambda: cells(screen, "#servers", "demo")[1] == "healthy")
        await until(pilot, lambda: cells(screen, "#layers", "0")[1] == f"{expected['slots_per_layer'][0]}/32")

        # r: re-profile in a worker, the progress bar moving, the UI answering meanwhile. Every line and bar
        # state the activity bar shows is recorded: with warm caches the demo's profile takes well under a
        # second, so a poll of the label can miss the prompts in between (a CI run saw only the last line)
        bar = screen.query_one(ProgressBar)
        said: list[str] = []
        shown_bars: list[tuple[bool, float | None, float]] = []
        activity_bar = screen.query_one(ActivityBar)
        say, progress = activity_bar.say, activity_bar.progress

        def recording_say(text: str) -> None:
            said.append(text)
            say(text)

        def recording_progress(done: int | None, total: int | None) -> None:
            progress(done, total)
            shown_bars.append((bool(bar.display), bar.total, bar.progress))

        activity_bar.say, activity_bar.progress = recording_say, recording_progress  # type: ignore[method-assign]
        await pilot.press("r")
        await pilot.pause(0.1)
        await pilot.press("y")
        await pilot.press("question_mark")  # the UI thread is free while the profiler runs
        await pilot.pause(0.1)
        await pilot.press("escape")
        await until(pilot, lambda: activity(screen).startswith(("profile of demo made again", "error:")), timeout=600)
        assert activity(screen).endswith("re-plan (p) to use it"), activity(screen)
        prompts = [t for t in said if t.startswith("profiling demo: prompt")]
        assert prompts and prompts[-1].split()[-1].split("/")[0] == prompts[-1].split("/")[-1], said
        assert any(shown and total and 0 < done <= total for shown, total, done in shown_bars), shown_bars

    run_app(check)
    assert gone(srv["pid"])  # the re-plan stopped the old server
    now = status(demo_home)["servers"][0]
    assert now["healthy"] and now["args"][-len(expected["server_args"]):] == expected["server_args"]
    # the slots of the plan it runs now, not the installed one's
    assert [layer["slots"] for layer in now["layers"]] == expected["slots_per_layer"] != [8] * 4
    assert profile.stat().st_mtime_ns > made
