"""The check at the end of `moeplug install` (operations.check), on the CPU build where it is off by
default and `--check` forces it: the placements run side by side through the same binary (the plan,
the plan made with the fitted figures where it differs, stock --fit's), every candidate's figures kept
in the verdict, the fastest served by the rule the module states (the best plan unless stock's
placement decodes faster), and what is served shown by `list`, `status` and the
proxies' configuration. Where a plan is held to 50x stock's decode (`--check-min 50`), stock's
placement is served and said.
Real builds, real servers, real rpc-servers on loopback for the remote-device plans, the demo model
in fresh homes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import moeplug, one_line_error, xdg_homes
from moeplug.operations.check import CHECK_BAR, CHECK_PROMPTS, CHECK_ROUNDS, choose
from moeplug.serving.installed import Candidate, Verdict

pytestmark = pytest.mark.native

LINE = re.compile(r"here: decode (\d+\.\d\d)x, prefill (\d+\.\d\d)x of stock --fit at (\S+ \S+|no GPU), (\d+) prompts, "
                  r"(\d+) rounds")


@pytest.fixture
def home(patched_build, tmp_path: Path) -> dict[str, str]:
    return xdg_homes(tmp_path)


def installed(home: dict[str, str]) -> dict:
    return json.loads((Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json").read_text())


def verdict_of(doc: dict) -> Verdict:
    verdict = Verdict.from_json(doc["verdict"])
    assert verdict is not None
    return verdict


def assert_chosen_by_the_rule(verdict: Verdict) -> None:
    """The verdict serves what its own figures say: the plan of the highest decode over stock's, unless
    that is below the bar; each candidate ran at least CHECK_ROUNDS rounds."""
    names = [c.name for c in verdict.candidates]
    assert names[-1] == "stock" and names[0] == "plan" and len(set(names)) == len(names), names
    for c in verdict.candidates:
        assert c.rounds >= CHECK_ROUNDS and c.decode_tps and c.decode_tps > 0 and c.prefill_tps > 0, c
        assert c.args, c
    stock = verdict.candidates[-1]
    assert stock.decode == pytest.approx(1.0) and stock.summary == "stock --fit"
    chosen, best = choose(verdict.candidates, verdict.bar)
    assert verdict.chosen == chosen and verdict.speed == best.speed
    assert verdict.decode == best.decode and verdict.prefill == best.prefill
    assert verdict.placement == ("stock" if chosen == "stock" else "moeplug")
    assert (chosen == "stock") == (best.speed < verdict.bar)
    assert best.speed == max(c.speed for c in verdict.candidates if c.name != "stock")
    assert stock.speed == pytest.approx(1.0) and all(c.prefill_weight == stock.prefill_weight
                                                     for c in verdict.candidates)


def test_choose_serves_the_fastest_plan_unless_stock_is_faster() -> None:
    """The rule on recorded figures: the faster plan wins; stock's placement where the best plan's speed
    is below the bar (1.0 by default: stock's is faster)."""
    def cand(name: str, speed: float) -> Candidate:
        return Candidate(name, "", ["-m", "x"], 2, decode_tps=100 * speed, decode=speed, speed=speed)

    stock = cand("stock", 1.0)
    assert choose([cand("plan", 1.30), cand("fitted", 1.45), stock], CHECK_BAR)[0] == "fitted"
    assert choose([cand("plan", 1.30), cand("fitted", 1.10), stock], CHECK_BAR)[0] == "plan"
    assert choose([cand("plan", 0.97), stock], CHECK_BAR)[0] == "stock"
    assert choose([cand("plan", 1.30), stock], 1.5)[0] == "stock"  # the bar asked for
    assert choose([cand("plan", 0.97), stock], 0.95)[0] == "plan"


def test_the_speed_weighs_prompts_as_the_plan_does() -> None:
    """A candidate's speed: generated tokens a second with the plan's prompt tokens prefilled for each,
    per prompt and round (Contender.mixed); decode alone at weight 0."""
    from moeplug.operations.bench import Side
    from moeplug.operations.check import Contender
    from moeplug.serving.measure import Timed

    side = Side([], {})
    side.timed["text"] = {0: [Timed(prompt_tokens=100, prefill=[2000.0], decode=100.0)]}
    assert Contender("plan", None, "", side, 0.0).mixed() == {0: [100.0]}
    # 1 generated token: 10 ms; 4 prompt tokens at 2000 t/s: 2 ms
    assert Contender("plan", None, "", side, 4.0).mixed()[0] == [pytest.approx(1 / 0.012)]


def test_the_check_runs_the_candidates_and_keeps_every_figure(home: dict[str, str]) -> None:
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--check", "--no-serve")
    assert r.returncode == 0, r.stderr[-3000:]
    line = LINE.search(r.stdout)
    assert line, r.stdout
    assert "checking 2 placements" in r.stderr  # no calibration on this machine: one plan, and stock's placement
    doc = installed(home)
    verdict = verdict_of(doc)
    assert verdict.prompts == CHECK_PROMPTS == int(line.group(4)) and verdict.rounds == int(line.group(5))
    assert round(verdict.decode, 2) == float(line.group(1)) and verdict.bar == CHECK_BAR
    starred = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("* ")]
    assert starred == [verdict.chosen], r.stdout  # the check's table: a row per candidate, the one served starred
    assert [c.name for c in verdict.candidates] == ["plan", "stock"]
    assert_chosen_by_the_rule(verdict)
    plan = next(c for c in verdict.candidates if c.name == "plan")
    assert plan.args == doc["plan"]["server_args"] and "--moe-cache-slots" in plan.args
    assert "--moe-cache-slots" not in verdict.candidates[-1].args and "--fit" in verdict.candidates[-1].args
    listed = moeplug(home, "list").stdout
    assert "checked 20" in listed and ("its plan, decode" in listed or "stock's placement, slots" in listed)
    # without --check on a machine with no GPU: not checked, and the record says nothing of it
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--no-serve")
    assert r.returncode == 0 and "here: decode" not in r.stdout and "verdict" not in installed(home)
    assert "its plan (not checked)" in moeplug(home, "list").stdout
    # a re-plan by `serve` is checked before it is served (forced here: no GPU), and served as checked
    try:
        r = moeplug(home, "serve", "demo", "--ctx", "2048", "--check", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        record = installed(home)
        again = verdict_of(record)
        assert record["plan"]["ctx"] == 2048 and "checking 2 placements" in r.stderr
        assert_chosen_by_the_rule(again)
        served = json.loads(r.stdout)["server"]["args"]
        assert ("--moe-cache-slots" in served) == (again.placement == "moeplug")
    finally:
        moeplug(home, "stop", "demo")


def test_three_candidates_the_fastest_served_and_kept(home: dict[str, str], rpc_hosts, tmp_path: Path) -> None:
    """A remote device on loopback, and a calibration written by hand whose hop to it (10 s) makes this
    machine's plan keep every layer here, where the fitted figures (a LAN's 1 ms) put layers there: two
    plans with different flags, and stock's placement over the same device. The check runs all three,
    records all three, and serves the one its figures name; the fitted figures are kept for re-plans
    where their plan won."""
    endpoints, _ = rpc_hosts
    cal = tmp_path / "far.json"
    cal.write_text(json.dumps({"cpu_expert_bytes_per_s": 20e9, "rpc_hop_s": 10.0}))
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--rpc", endpoints[0], "--calibration", str(cal),
                "--check", "--no-serve", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert "checking 3 placements" in r.stderr
    verdict = Verdict.from_json(doc["verdict"])
    assert verdict is not None and [c.name for c in verdict.candidates] == ["plan", "fitted", "stock"]
    plan, fitted, stock = verdict.candidates
    assert plan.args != fitted.args and "--rpc" in stock.args
    assert "the calibration file" in plan.costs and "fitted figures" in fitted.costs
    assert_chosen_by_the_rule(verdict)
    record = installed(home)
    best = max((plan, fitted), key=lambda c: c.speed)
    assert record["plan"]["server_args"] == best.args  # the best plan kept, whichever was served
    assert record["request"].get("costs", "machine") == ("fitted" if best is fitted else "machine")
    shown = moeplug(home, "list").stdout
    assert "checked" in shown and ("(fitted figures)" in shown) == (verdict.chosen == "fitted")


def test_a_plan_slower_here_serves_stocks_placement_and_says_so(home: dict[str, str]) -> None:
    """The plan held to 50x stock's decode (`--check-min 50`): no plan reaches it, so the check serves
    stock --fit's flags through the same binary, and status, list, a later serve and the proxies' files
    say so. (A plan slowed for real, one thread against every core, does not lose reliably on so small
    a model: thread start-up costs as much as the arithmetic.)"""
    preset = Path(home["XDG_DATA_HOME"]) / "presets.ini"
    assert moeplug(home, "hook", "llama-server", "--preset", str(preset)).returncode == 0
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--check", "--check-min", "50", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        doc = json.loads(r.stdout)
        assert doc["verdict"]["placement"] == "stock", doc["verdict"]
        assert doc["verdict"]["bar"] == 50 and 0 < doc["verdict"]["speed"] < 50
        assert doc["verdict"]["chosen"] == "stock" and len(doc["verdict"]["candidates"]) == 2
        assert "serving stock's placement: the slots ran" in r.stderr and "below 50.00x" in r.stderr
        args = doc["server"]["args"]
        assert "--moe-cache-slots" not in args and "--fit" in args and "-t" not in args
        status = json.loads(moeplug(home, "status", "--json").stdout)["servers"][0]
        assert status["placement"] == "stock" and "serving stock's placement" in status["placement_why"]
        assert "checked 20" in status["placement_why"]
        assert "serving stock's placement" in moeplug(home, "status").stdout
        assert "stock's placement, slots" in moeplug(home, "list").stdout
        # the router's preset follows the verdict: stock's flags, no slots
        text = preset.read_text()
        assert "[demo]" in text and "moe-cache-slots" not in text and "fit" in text
        # a later `moeplug serve` keeps serving what the check chose
        assert moeplug(home, "stop", "demo").returncode == 0
        served = json.loads(moeplug(home, "serve", "demo", "--json").stdout)["server"]
        assert "--moe-cache-slots" not in served["args"] and "--fit" in served["args"]
        assert "re-planned since" not in moeplug(home, "list").stdout
        # re-planned and served unchecked (no GPU): the verdict stands, and list and status say it is older
        assert moeplug(home, "stop", "demo").returncode == 0
        assert moeplug(home, "serve", "demo", "--ctx", "2048").returncode == 0
        assert "checked 20" in moeplug(home, "list").stdout and "re-planned since" in moeplug(home, "list").stdout
        assert "re-planned since" in json.loads(moeplug(home, "status", "--json").stdout)["servers"][0]["placement_why"]
    finally:
        moeplug(home, "stop", "demo")


def test_a_bar_out_of_range_is_one_line(home: dict[str, str]) -> None:
    r = moeplug(home, "install", "demo", "--check", "--check-min", "0", "--no-serve")
    one_line_error(r, 2, "--check-min", "out of range")
    assert not (Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json").exists()
