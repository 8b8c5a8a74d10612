"""The dashboard's layout from a recorded snapshot (no server needed): the README's screenshot,
80x24, the keys. The screenshot is rendered from the fixed snapshot of conftest.py at a fixed
size and compared with the committed SVG, so a change to the dashboard shows up here; look at
the new one and regenerate it with MOEPLUG_UPDATE_SCREENSHOT=1."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from textual.widgets import DataTable, Static

from moeplug.serving.monitor import Snapshot
from moeplug.tui.app import make_app
from moeplug.tui.screens.help import HelpScreen
from moeplug.tui.screens.main import MainScreen

SCREENSHOT = Path(__file__).resolve().parents[2] / "tui" / "dashboard.svg"
SIZE = (80, 24)


async def _render(snap: Snapshot, size: tuple[int, int]) -> str:
    """The main screen once it has settled: the same frame three times, 0.2 s apart (layout and
    scrollbars come a few frames after the data, later on a loaded machine)."""
    app = make_app(interval=0, snapshots=[snap])
    async with app.run_test(size=size) as pilot:
        while not isinstance(app.screen, MainScreen) or app.screen.refreshes < 1:
            await pilot.pause(0.05)
        frames = [""]
        while len(frames) < 4 or len(set(frames[-3:])) > 1:
            assert len(frames) < 100, "the dashboard never settles"
            await pilot.pause(0.2)
            frames.append(app.export_screenshot(title="moeplug tui"))
        return frames[-1]


def test_screenshot_matches_the_committed_one(recorded: Snapshot) -> None:
    svg = asyncio.run(_render(recorded, SIZE))
    assert svg == asyncio.run(_render(recorded, SIZE)), "the render is not deterministic"
    if os.environ.get("MOEPLUG_UPDATE_SCREENSHOT") or not SCREENSHOT.exists():
        SCREENSHOT.write_text(svg, encoding="utf-8")
    assert svg == SCREENSHOT.read_text(encoding="utf-8"), \
        f"the dashboard renders differently from {SCREENSHOT}: check it, then MOEPLUG_UPDATE_SCREENSHOT=1"


def test_everything_fits_80x24(recorded: Snapshot) -> None:
    async def run() -> None:
        app = make_app(interval=0, snapshots=[recorded])
        async with app.run_test(size=(80, 24)) as pilot:
            while not isinstance(app.screen, MainScreen) or app.screen.refreshes < 1:
                await pilot.pause(0.05)
            for selector in ("#servers", "#slots", "#gpus", "#plan", "#activity", "Footer"):
                region = app.screen.query_one(selector).region
                assert region.width > 0 and region.height > 0, selector
                assert region.right <= 80 and region.bottom <= 24, (selector, region)
            servers = app.screen.query_one("#servers", DataTable)
            assert [str(k.value) for k in servers.rows] == ["qwen3-moe-a2b", "demo"]
            assert servers.get_row("demo")[1] == "stopped"
            layers = app.screen.query_one("#layers", DataTable)
            assert layers.get_row("3") == ["3", "40/64", "partly", "86.0%", "84.0%"]
            assert layers.get_row("0")[2] == "whole"
            gpu = str(app.screen.query_one("#gpus", Static).render())
            assert "RTX 4090" in gpu and "11.4/24.0 GiB" in gpu and "planned budget 12.0 GiB" in gpu

    asyncio.run(run())


def test_keys_help_and_quit(recorded: Snapshot) -> None:
    async def run() -> None:
        app = make_app(interval=0, snapshots=[recorded])
        async with app.run_test(size=(80, 24)) as pilot:
            while not isinstance(app.screen, MainScreen):
                await pilot.pause(0.05)
            await pilot.press("question_mark")
            await pilot.pause(0.1)
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            await pilot.pause(0.1)
            assert isinstance(app.screen, MainScreen)
            await pilot.press("q")
            await pilot.pause(0.1)
        assert app.return_code == 0

    asyncio.run(run())


def test_tui_bad_input_is_one_line() -> None:
    def tui(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "moeplug", "tui", *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=60)

    r = tui("--interval", "0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--interval: 0 is out of range" in r.stderr, r.stderr
    r = tui()  # output to a pipe: no terminal to draw on
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "needs a terminal" in r.stderr, r.stderr
    assert r.stdout == ""


def test_a_model_served_with_stocks_placement_says_why(recorded: Snapshot) -> None:
    """Where the install's check found the plan slower here, the slots panel and the plan panel say
    the model runs stock's placement, and why (operations.check)."""
    from dataclasses import replace

    from moeplug.tui.widgets.plan import plan_lines
    from moeplug.tui.widgets.slots import summary_lines

    why = "serving stock's placement: the slots ran 0.81x here; 'moeplug bench' to look closer"
    served = replace(recorded.servers[0], placement="stock", placement_why=why)
    assert f"served with stock's placement: {why}" in summary_lines(served)
    assert why in plan_lines(served, recorded.taken_at)
    assert not any("stock's placement" in line for line in summary_lines(recorded.servers[0]))


def _split_over_devices(recorded: Snapshot) -> Snapshot:
    """The recorded model's plan split over a remote device (an rpc-server on the LAN) and this
    machine's GPU, as llama.cpp orders them (remote first)."""
    from dataclasses import replace

    from moeplug.planner.multi_gpu import DevicePlan

    gib = 1 << 30
    devices = [DevicePlan("RPC0", 20 * gib, [0, 1, 2, 3], False, 4, 3, 40, 0, 0, 0, 0, 0, endpoint="192.168.1.20:50052"),
               DevicePlan("CUDA0", 12 * gib, list(range(4, 12)), True, 8, 0, 212, 0, 0, 0, 0, 0)]
    served = recorded.servers[0]
    return replace(recorded, servers=[replace(served, plan=replace(served.plan, devices=devices))])


async def _shown(snap: Snapshot, size: tuple[int, int] = SIZE) -> tuple[str, list[str]]:
    """The slots panel's summary once the dashboard shows the snapshot, and the panels that do not fit."""
    app = make_app(interval=0, snapshots=[snap])
    async with app.run_test(size=size) as pilot:
        while not isinstance(app.screen, MainScreen) or app.screen.refreshes < 1:
            await pilot.pause(0.05)
        outside = [sel for sel in ("#servers", "#slots", "#gpus", "#plan", "#activity", "Footer")
                   if app.screen.query_one(sel).region.right > size[0] or app.screen.query_one(sel).region.bottom > size[1]]
        return str(app.screen.query_one("#slots-summary", Static).render()), outside


def test_a_plan_over_several_devices_shows_a_line_per_device(recorded: Snapshot) -> None:
    """Each device of the plan in the slots panel: its name, where it is (this machine, or its
    rpc-server), its blocks, whole layers of its MoE layers, slots and budget; at 80x24 too."""
    summary, outside = asyncio.run(_shown(_split_over_devices(recorded)))
    lines = summary.splitlines()
    assert "RPC0 192.168.1.20:50052: blk 0-3, 3/4 whole, 40 slots, 20.00 GiB" in lines, lines
    assert "CUDA0 this machine: blk 4-11 + output, 0/8 whole, 212 slots, 12.00 GiB" in lines, lines
    assert outside == []
    # a plan on one device has no such line: the screenshot above stays as it was
    assert not any("this machine" in line for line in asyncio.run(_shown(recorded))[0].splitlines())


def test_a_model_that_is_down_says_why_first(recorded: Snapshot) -> None:
    """A server that ended (here: llama.cpp aborted it when a remote host dropped): the slots panel's
    first line says so and why, as `moeplug status` does."""
    from dataclasses import replace

    why = ("Remote RPC server crashed or returned malformed response (ggml-rpc.cpp:566); now 192.168.1.20:50052 "
           "does not answer (Connection refused)")
    split = _split_over_devices(recorded)
    down = replace(split, servers=[replace(split.servers[0], alive=False, healthy=False, state_why=why)])
    summary, outside = asyncio.run(_shown(down))
    assert summary.splitlines()[0] == f"down: {why}" and outside == []
    assert "RPC0 192.168.1.20:50052: blk 0-3, 3/4 whole, 40 slots, 20.00 GiB" in summary.splitlines()
