"""The check at the end of `moeplug install` (operations.check), on the CPU build where it is off by
default and `--check` forces it: the plan against stock --fit through the same binary, one line of
ratios, the verdict kept with the model and shown by `list` and `status`; and where the plan is made
slower than the user asks for (`--check-min` above anything the demo reaches), stock's placement
served and said.
Real builds, real servers, the demo model in fresh homes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import moeplug, one_line_error, xdg_homes
from moeplug.operations.check import CHECK_SLOWER

pytestmark = pytest.mark.native

LINE = re.compile(r"here: decode (\d+\.\d\d)x, prefill (\d+\.\d\d)x of stock --fit at no GPU, 3 prompts")


@pytest.fixture
def home(patched_build, tmp_path: Path) -> dict[str, str]:
    return xdg_homes(tmp_path)


def installed(home: dict[str, str]) -> dict:
    return json.loads((Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json").read_text())


def test_the_check_measures_the_plan_against_stock_and_keeps_its_verdict(home: dict[str, str]) -> None:
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--check", "--no-serve")
    assert r.returncode == 0, r.stderr[-3000:]
    line = LINE.search(r.stdout)
    assert line, r.stdout
    decode = float(line.group(1))
    verdict = installed(home)["verdict"]
    assert verdict["prompts"] == 3 and round(verdict["decode"], 2) == decode
    assert verdict["placement"] == ("stock" if verdict["decode"] < CHECK_SLOWER else "moeplug")
    listed = moeplug(home, "list").stdout
    assert f"(decode {decode:.2f}x here)" in listed
    # without --check on a machine with no GPU: not checked, and the record says nothing of it
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--no-serve")
    assert r.returncode == 0 and "here: decode" not in r.stdout and "verdict" not in installed(home)
    assert "its plan (not checked)" in moeplug(home, "list").stdout


def test_a_plan_slower_here_serves_stocks_placement_and_says_so(home: dict[str, str]) -> None:
    """The plan held to 50x stock's decode (`--check-min 50`): the demo's slots on the CPU run near
    stock's speed, so the check finds the plan slower than asked, and the model is served with stock
    --fit's flags through the same binary. (A plan slowed for real, one thread against every core,
    does not lose reliably on so small a model: thread start-up costs as much as the arithmetic.)"""
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--check", "--check-min", "50", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        doc = json.loads(r.stdout)
        assert doc["verdict"]["placement"] == "stock", doc["verdict"]
        assert doc["verdict"]["bar"] == 50 and 0 < doc["verdict"]["decode"] < 50
        assert "serving stock's placement: the slots ran" in r.stderr and "below 50.00x" in r.stderr
        args = doc["server"]["args"]
        assert "--moe-cache-slots" not in args and "--fit" in args and "-t" not in args
        status = json.loads(moeplug(home, "status", "--json").stdout)["servers"][0]
        assert status["placement"] == "stock" and "serving stock's placement" in status["placement_why"]
        assert "serving stock's placement" in moeplug(home, "status").stdout
        assert "stock's placement (decode" in moeplug(home, "list").stdout
        # a later `moeplug serve` keeps serving what the check chose
        assert moeplug(home, "stop", "demo").returncode == 0
        served = json.loads(moeplug(home, "serve", "demo", "--json").stdout)["server"]
        assert "--moe-cache-slots" not in served["args"] and "--fit" in served["args"]
    finally:
        moeplug(home, "stop", "demo")


def test_a_bar_out_of_range_is_one_line(home: dict[str, str]) -> None:
    r = moeplug(home, "install", "demo", "--check", "--check-min", "0", "--no-serve")
    one_line_error(r, 2, "--check-min", "out of range")
    assert not (Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json").exists()
