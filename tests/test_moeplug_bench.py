"""`moeplug bench NAME`: the installed plan against stock llama-server --fit at the same budget, the
real command on the demo model (CPU build: both sides on the CPU, the slots in RAM) in fresh XDG
homes sharing the built binaries."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest
from helpers import XdgHome, moeplug, xdg_homes

from moeplug.operations.bench import FIT_PAD_MIB, fit_within, raised_fit_target, with_threads
from moeplug.core.errors import MoeplugError
from moeplug.core.sizes import MIB
from moeplug.serving.traffic import parse_requests

pytestmark = pytest.mark.native


@pytest.fixture
def demo_installed(home: XdgHome, patched_build, stock_build) -> None:
    """The demo installed in the test's home; the stock build there too, which stock's side runs."""
    r = moeplug(home, "install", "demo", "--no-serve", "--ctx", "1024")
    assert r.returncode == 0, r.stderr[-3000:]


def installed(env: dict[str, str]) -> dict:
    return json.loads((Path(env["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json").read_text())


@pytest.mark.usefixtures("demo_installed")
def test_bench_serves_the_plan_and_stock_in_turns(home: XdgHome) -> None:
    # -n 18: answers longer than a short answer's 16 steps, so each prompt is also answered in 16
    r = moeplug(home, "bench", "demo", "--rounds", "2", "-n", "18", "--max-prompts", "2", "--prefill-reps", "2",
                "--chat", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    plan = installed(home)["plan"]
    mine, stock = doc["sides"]["moeplug"], doc["sides"]["stock"]
    # moeplug's side exactly as `moeplug serve` starts it; stock's with --fit at the budget and nothing of ours
    # (the demo's slots in RAM are its plan's own flag, no variable of the environment)
    assert mine["args"] == plan["server_args"] and mine["env"] == {} and "--moe-cache-device" in mine["args"]
    assert stock["args"][:6] == ["-c", "1024", "--fit", "on", "-fitt", "0"] and stock["env"] == {}
    assert not any(a.startswith("--moe-cache") for a in stock["args"])
    assert doc["other"] == "stock" and set(doc["sides"]) == {"moeplug", "stock"}
    # two launches a side; the cache engaged on moeplug's (its log said so), not asked for on stock's
    assert [c["engaged"] for c in mine["cache"]] == [True, True] and stock["cache"] == [None, None]
    assert "round 1 of 2: moeplug llama-server" in r.stderr and "round 2 of 2: stock llama-server" in r.stderr
    text, chat = doc["workloads"]["text"], doc["workloads"]["chat"]
    assert text["prompts"] == 2 and chat["prompts"] == 6  # two prompts, each three turns
    for w in (text, chat):
        for row in w["rows"]:
            for what in ("prefill", "first", "decode"):
                d = row[what]
                assert d["moeplug_tps"] > 0 and d["stock_tps"] > 0
                assert d["ratio"] == pytest.approx(d["moeplug_tps"] / d["stock_tps"])
        for what in ("prefill", "first", "decode"):
            per = [row[what]["ratio"] for row in w["rows"]]
            lo, hi = w[what].pop("ratio_interval")  # two rounds: the median ratio's interval over them
            assert 0 < lo <= hi
            assert w[what] == pytest.approx({"ratio_median": statistics.median(per), "ratio_lowest": min(per)})
    # a conversation's opening turns apart from its later ones: the same per-turn ratios, split by turn
    for key, turns in (("opening", (0, 3)), ("later", (1, 2, 4, 5))):
        assert set(chat[key]) == {"prefill", "decode"}
        for what in ("prefill", "decode"):
            per = [row[what]["ratio"] for row in chat["rows"] if row["prompt"] in turns]
            lo, hi = chat[key][what].pop("ratio_interval")
            assert 0 < lo <= hi
            assert chat[key][what] == pytest.approx({"ratio_median": statistics.median(per), "ratio_lowest": min(per)})
    assert "opening" not in text
    # each prompt's short answer (16 steps after a new prompt) apart; chat turns have none
    for row in text["rows"]:
        d = row["decode_short"]
        assert d["moeplug_tps"] > 0 and d["stock_tps"] > 0 and d["ratio"] == pytest.approx(d["moeplug_tps"] / d["stock_tps"])
    per = [row["decode_short"]["ratio"] for row in text["rows"]]
    lo, hi = text["decode_short"].pop("ratio_interval")
    assert 0 < lo <= hi
    assert text["decode_short"] == pytest.approx({"ratio_median": statistics.median(per), "ratio_lowest": min(per)})
    assert "decode_short" not in chat and not any("decode_short" in row for row in chat["rows"])
    # round by round, each side's median over the prompts (two rounds, two launches a side)
    for w in (text, chat):
        for side in ("moeplug", "stock"):
            for what in ("prefill", "decode"):
                r = w["per_round"][side][what]
                assert len(r) == 2 and all(x > 0 for x in r)
    # a chat turn after the first prefilled its own text: the conversation before it came from the prompt cache
    rows = chat["rows"]
    for before, turn in ((rows[i], rows[i + 1]) for i in (0, 1, 3, 4)):
        assert turn["context_tokens"] > before["context_tokens"] + 18  # the answer (-n 18) and the turn's text
        assert turn["context_tokens"] - turn["prompt_tokens"] >= before["context_tokens"]
    assert any("no NVIDIA GPU" in n for n in doc["notes"])
    # nothing left running
    status = moeplug(home, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["servers"] == []


@pytest.mark.usefixtures("demo_installed")
def test_bench_text_output(home: XdgHome, stock_build, patched_build) -> None:
    r = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                "--chat")
    assert r.returncode == 0, r.stderr[-3000:]
    # the build each side ran: stock's an unpatched one of the pin
    assert (f"builds: moeplug {patched_build.build_id}; stock {stock_build.build_id} (unpatched llama.cpp of the same "
            f"pin)") in r.stdout
    assert "demo: moeplug's plan against stock llama-server --fit at the same budget" in r.stdout
    assert "prefill t/s moeplug / stock" in r.stdout and "of stock (median over 1 prompts)" in r.stdout
    assert "of stock (median over 3 chat turns)" in r.stdout
    assert re.search(r"opening turns alone \(a new conversation, on the slots another one left\): prefill [\d.]+x "
                     r"\(lowest [\d.]+x\), decode [\d.]+x \(lowest [\d.]+x\); later turns: prefill", r.stdout)
    assert "first request alone" not in r.stdout  # one request per prompt: nothing apart
    assert "95% interval" not in r.stdout  # one round: no interval over rounds
    assert "short answers alone" not in r.stdout  # -n 2: every answer is short
    assert "round by round" not in r.stdout  # one round
    longer = moeplug(home, "bench", "demo", "--rounds", "2", "-n", "20", "--max-prompts", "1", "--prefill-reps", "1")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert re.search(r"short answers alone \(16 tokens, a new prompt on the slots another prompt left\): decode "
                     r"[\d.]+x \(lowest [\d.]+x", longer.stdout)
    assert re.search(r"decode t/s round by round \(median over the prompts; a round off on one side is a server process "
                     r"that ran slow\): moeplug [\d.]+, [\d.]+; stock [\d.]+, [\d.]+\n", longer.stdout)


@pytest.mark.usefixtures("demo_installed")
def test_bench_stock_held_to_the_budget_without_a_gpu(home: XdgHome) -> None:
    """--stock-vram budget: kept in the JSON; without a GPU there is no VRAM to hold stock to, so no
    calibrating launch, -fitt as given, and a note says so."""
    r = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                "--stock-vram", "budget", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["stock_vram"] == "budget" and doc["fit_tries"] == []
    assert doc["sides"]["stock"]["args"][:6] == ["-c", "1024", "--fit", "on", "-fitt", "0"]
    assert any("stock is not held to the budget" in n for n in doc["notes"])
    assert "the VRAM it holds" not in r.stderr  # no launch of stock before the rounds


def test_stock_fit_target_rises_by_what_it_held_over() -> None:
    """Stock held to the budget: -fitt (MiB kept free) rises by the MiB held over the budget, rounded
    up, and a pad."""
    assert raised_fit_target("126000", (16384 + 170) * MIB, 16384 * MIB) == str(126000 + 170 + FIT_PAD_MIB)
    assert raised_fit_target("126000", 16384 * MIB + 1, 16384 * MIB) == str(126000 + 1 + FIT_PAD_MIB)


@pytest.mark.parametrize("held_mib, fitts, raises", [
    ([16538, 16334], [126771, 126771 + 154 + FIT_PAD_MIB], False),  # the H200's 16 GiB launches (run `2026-12-03-stock-at-budget`)
    ([16384], [126771], False),                                     # exactly the budget: left as it is
    ([None], [126771], False),                                      # no NVML count: nothing to go by
    ([16538, 16400, 16390, 16385], [126771, 126941, 126973, 126995], True),  # never within: one line, after 4
])
def test_fit_within_raises_stock_until_it_holds_the_budget(held_mib: list[int | None], fitts: list[int],
                                                           raises: bool) -> None:
    """fit_within launches (here: what each launch held, in order) until one holds no more than the
    budget, raising -fitt in the arguments after each launch over it."""
    args = ["-c", "4096", "--fit", "on", "-fitt", "126771", "-lm", "none"]
    seen: list[int] = []
    held = iter(held_mib)

    def held_by(a: list[str]) -> int | None:
        seen.append(int(a[a.index("-fitt") + 1]))
        h = next(held)
        return None if h is None else h * MIB

    if raises:
        with pytest.raises(MoeplugError, match="still held 16385 MiB, over the 16384 MiB budget, after 4 launches"):
            fit_within(args, 16384 * MIB, held_by)
    else:
        tried = fit_within(args, 16384 * MIB, held_by)
        assert [t["fitt"] for t in tried] == fitts
        assert args[5] == str(fitts[-1])
    assert seen == fitts


@pytest.mark.usefixtures("demo_installed")
def test_bench_threads_on_either_side(home: XdgHome) -> None:
    """--threads N runs moeplug's side on N threads in place of the plan's (the installed plan kept),
    --stock-threads N stock's; --stock-ubatch N runs stock's prompt batches of N, and a note says the
    two sides' differ; the servers' logs say so, and the text names each side's count."""
    plan_before = installed(home)["plan"]
    r = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                "--threads", "1", "--stock-threads", "2", "--stock-ubatch", "64", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    mine, stock = doc["sides"]["moeplug"]["args"], doc["sides"]["stock"]["args"]
    assert mine == [a for a in with_threads(plan_before["server_args"], 0)] + ["-t", "1"]
    assert stock[-2:] == ["-t", "2"] and stock[:6] == ["-c", "1024", "--fit", "on", "-fitt", "0"]
    assert stock[-6:-2] == ["-b", "2048", "-ub", "64"] and "-ub" not in mine
    assert any(n.startswith("prompt batches of 512 tokens on moeplug's side, 64 on stock's") for n in doc["notes"])
    assert installed(home)["plan"] == plan_before
    # the last launch of round 1 was stock's: its log is the one left
    log = (Path(home["XDG_STATE_HOME"]) / "moeplug" / "logs" / "server-bench-demo.log").read_text()
    assert "n_threads = 2 (n_threads_batch = 2)" in log and re.search(r"n_ubatch += 64\n", log)
    text = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                   "--threads", "0")
    assert text.returncode == 0 and "CPU threads: moeplug llama.cpp's default, stock llama.cpp's default" in text.stdout
    assert "prompt batch: moeplug 512, stock 512" in text.stdout and "prompt batches of" not in text.stdout


@pytest.mark.usefixtures("demo_installed")
def test_bench_times_long_prompts_of_the_planned_length(home: XdgHome) -> None:
    """A plan made for prompts of N tokens (--prompt-tokens, or learned by reprofile) is also timed on
    two prompts of exactly N tokens, the bundled texts one after another as the server tokenizes them,
    the same tokens on both sides; --prompt-tokens 0 leaves them out, and a length the context cannot
    hold is one line."""
    assert moeplug(home, "serve", "demo", "--prompt-tokens", "700").returncode == 0  # kept with the plan
    assert moeplug(home, "stop", "demo").returncode == 0
    assert installed(home)["plan"]["prompt_tokens"] == 700
    r = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "2", "--prefill-reps", "2",
                "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    long = json.loads(r.stdout)["workloads"]["long"]
    assert long["prompts"] == 2 and [row["prompt_tokens"] for row in long["rows"]] == [700, 700]
    for row in long["rows"]:
        assert row["prefill"]["ratio"] == pytest.approx(row["prefill"]["moeplug_tps"] / row["prefill"]["stock_tps"])
    assert long["prefill"]["ratio_median"] > 0 and long["decode"]["ratio_median"] > 0
    text = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                   "--prompt-tokens", "300")
    assert text.returncode == 0 and "long prompts (the prompts' text" in text.stdout
    assert "of stock (median over 2 long prompts)" in text.stdout
    none = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                   "--prompt-tokens", "0", "--json")
    assert none.returncode == 0 and list(json.loads(none.stdout)["workloads"]) == ["text"]
    big = moeplug(home, "bench", "demo", "--prompt-tokens", "1020")
    assert big.returncode == 1 and "do not fit the plan's context of 1024" in big.stderr
    assert len(big.stderr.strip().splitlines()) == 1


@pytest.mark.usefixtures("demo_installed")
def test_bench_times_short_prompts(home: XdgHome) -> None:
    """--short N: each prompt's first N tokens as the server tokenizes them, the same tokens on both
    sides, a workload of its own; out of range, or longer than every prompt, one line."""
    r = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "2", "--prefill-reps", "2",
                "--short", "12", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert list(doc["workloads"]) == ["text", "short"]
    short, text = doc["workloads"]["short"], doc["workloads"]["text"]
    assert short["prompts"] == 2 and [row["prompt_tokens"] for row in short["rows"]] == [12, 12]
    assert all(row["prompt_tokens"] > 12 for row in text["rows"])
    for row in short["rows"]:
        assert row["prefill"]["ratio"] == pytest.approx(row["prefill"]["moeplug_tps"] / row["prefill"]["stock_tps"])
    out = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "2",
                  "--short", "8")
    assert out.returncode == 0 and "short prompts (each prompt's first tokens" in out.stdout
    assert "of stock (median over 1 short prompts)" in out.stdout
    assert out.stdout.count("each prompt's first request alone") == 2  # the text's and the short prompts'
    for bad in ("0", "5000", "x"):
        r = moeplug(home, "bench", "demo", "--short", bad)
        assert r.returncode == 2 and "--short" in r.stderr and "Traceback" not in r.stderr
    long = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--short", "4096")
    assert long.returncode == 1 and "no prompt is 4096 tokens long" in long.stderr
    errors = [line for line in long.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in long.stderr  # after the first launch's progress line
    status = moeplug(home, "status", "--json")  # the launch it was found at is stopped again
    assert status.returncode == 0 and json.loads(status.stdout)["servers"] == []


def _most_in_flight(log: str) -> int:
    """The most requests llama-server's log shows processing at once: slots between "processing task"
    and "stop processing"."""
    busy: set[int] = set()
    most = 0
    for slot, what in re.findall(r"id +(\d+) \| task -?\d+ \| (processing task|stop processing)", log):
        (busy.add if what == "processing task" else busy.discard)(int(slot))
        most = max(most, len(busy))
    return most


@pytest.mark.usefixtures("demo_installed")
def test_bench_sends_prompts_together(home: XdgHome, tmp_path: Path) -> None:
    """--concurrent N: the prompts in groups of N sent at once; llama-server (4 parallel slots by
    default) processes them together, on moeplug's side as on stock's, and a group's row is the
    group's aggregate: its prompts' tokens, the same as those prompts alone."""
    r = moeplug(home, "bench", "demo", "--rounds", "2", "-n", "8", "--max-prompts", "6", "--prefill-reps", "1",
                "--concurrent", "3", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    text, together = doc["workloads"]["text"], doc["workloads"]["concurrent"]
    assert text["prompts"] == 6 and together["prompts"] == 2  # six prompts, two groups of three
    alone = [row["prompt_tokens"] for row in text["rows"]]
    assert [row["prompt_tokens"] for row in together["rows"]] == [sum(alone[:3]), sum(alone[3:])]
    for row in together["rows"]:
        for what in ("prefill", "decode"):
            d = row[what]
            assert d["moeplug_tps"] > 0 and d["stock_tps"] > 0
            assert d["ratio"] == pytest.approx(d["moeplug_tps"] / d["stock_tps"])
    assert together["decode"]["ratio_median"] > 0 and together["decode"]["ratio_interval"] is not None
    # four slots by default: nothing added to either side's flags
    assert "-np" not in doc["sides"]["moeplug"]["args"] and "-np" not in doc["sides"]["stock"]["args"]
    # the last launch was moeplug's (round 2 runs stock first): its server had three requests at once
    log = (Path(home["XDG_STATE_HOME"]) / "moeplug" / "logs" / "server-bench-demo.log").read_text(errors="replace")
    assert "--moe-cache-slots" in " ".join(doc["sides"]["moeplug"]["args"]) and "moe-cache:" in log
    assert _most_in_flight(log) == 3
    # what `moeplug reprofile` learns the workload from counts every request of a group once: the
    # launch's context probe, the warm-up, six prompts one at a time, then the two groups' six
    done = parse_requests(log)
    assert len(done) == 14 and [r.generated_tokens for r in done[-6:]] == [8] * 6
    assert sorted(r.prompt_tokens for r in done[-6:]) == sorted(alone)
    short = tmp_path / "short.txt"
    short.write_text("Name three colours.\n---\nWhat is two plus two?\n")
    text_out = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "4", "--prefill-reps", "1", "--concurrent", "6",
                       "--prompt-file", str(short))
    assert text_out.returncode == 0, text_out.stderr[-3000:]
    assert "prompts sent together (a row is a group" in text_out.stdout and "(median over 1 groups)" in text_out.stdout
    assert "6 parallel slots on both sides (-np 6 -kvu)" in text_out.stdout
    # more prompts at once than the plan's context holds: one line before any is sent
    full = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "4", "--prefill-reps", "1", "--concurrent", "64")
    assert full.returncode == 1 and "Traceback" not in full.stderr
    assert "64 prompts at once need" in full.stderr and "the plan's is 1024" in full.stderr
    assert full.stderr.strip().splitlines()[-1].startswith("moeplug: error: 64 prompts at once need")


def test_with_threads_replaces_the_count() -> None:
    assert with_threads(["-c", "512", "-t", "8", "-ngl", "99"], None) == ["-c", "512", "-t", "8", "-ngl", "99"]
    assert with_threads(["-c", "512", "-t", "8", "-ngl", "99"], 3) == ["-c", "512", "-ngl", "99", "-t", "3"]
    assert with_threads(["--threads", "8", "-c", "512"], 0) == ["-c", "512"]
    assert with_threads(["-c", "512"], 4) == ["-c", "512", "-t", "4"]


@pytest.mark.usefixtures("demo_installed")
def test_bench_bad_input_is_one_line(home: XdgHome, tmp_path: Path) -> None:
    for args, code, said in ((("bench", "nothing"), 1, "'nothing' is not installed"),
                             (("bench", "demo", "--rounds", "0"), 2, "--rounds"),
                             (("bench", "demo", "--prefill-reps", "33"), 2, "--prefill-reps"),
                             (("bench", "demo", "-n", "0"), 2, "-n/--n-predict"),
                             (("bench", "demo", "--stock-vram", "all"), 2, "--stock-vram"),
                             (("bench", "demo", "--threads", "-2"), 2, "--threads"),
                             (("bench", "demo", "--stock-threads", "x"), 2, "--stock-threads"),
                             (("bench", "demo", "--stock-ubatch", "31"), 2, "--stock-ubatch"),
                             (("bench", "demo", "--prompt-tokens", "-5"), 2, "--prompt-tokens"),
                             (("bench", "demo", "--concurrent", "1"), 2, "--concurrent"),
                             (("bench", "demo", "--prompt-file", str(tmp_path / "none.txt")), 1, "none.txt")):
        r = moeplug(home, *args)
        assert r.returncode == code and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    # a served model: the two servers would share the GPU with it
    served = moeplug(home, "serve", "demo")
    assert served.returncode == 0, served.stderr[-3000:]
    try:
        r = moeplug(home, "bench", "demo")
        assert r.returncode == 1 and "'moeplug stop demo' first" in r.stderr and "Traceback" not in r.stderr
    finally:
        assert moeplug(home, "stop", "demo").returncode == 0


def test_the_prompts_below_stock_are_named() -> None:
    """Under each table, one line names the prompts whose prefill, decode or short answers' decode ran below
    0.97x of stock."""
    from moeplug.commands.bench import _below_par

    def row(i: int, prefill: float, decode: float | None) -> dict:
        return {"prompt": i, "prefill": {"ratio": prefill}, "decode": {"ratio": decode}}

    rows = [row(0, 0.93, 1.2), row(1, 1.1, 0.9), row(2, 0.97, 0.97), row(3, 0.951, None)]
    assert _below_par(rows, "chat turns") == ("below 0.97x of stock here, of the 4 chat turns: prefill #0 0.93x, "
                                             "#3 0.95x; decode #1 0.90x")
    assert _below_par([row(0, 1.0, 1.3)], "prompts") is None
    # a short answer's decode, where the prompts have one
    short = [row(0, 1.0, 1.3) | {"decode_short": {"ratio": 0.94}}, row(1, 1.0, 0.96) | {"decode_short": {"ratio": 1.1}}]
    assert _below_par(short, "prompts") == ("below 0.97x of stock here, of the 2 prompts: decode #1 0.96x; short "
                                            "answers' decode #0 0.94x")


def test_stock_over_the_budget_is_said() -> None:
    """Where stock, given the budget as users run it, held more than the budget (NVML), a line says by how
    much, beside moeplug, and how to compare at the same VRAM; not where it held no more, nor when stock
    was already held to the budget, nor for a budget per GPU."""
    from moeplug.commands.bench import _stock_over

    budget = 16384 * MIB
    said = _stock_over(budget, 16518 * MIB, 16340 * MIB, "fit")
    assert said == ("stock held 134.00 MiB more than the budget and 178.00 MiB more than moeplug ('--stock-vram "
                    "budget' holds stock to the budget, to compare at the same VRAM)")
    assert _stock_over(budget, 16278 * MIB, 16340 * MIB, "fit") is None
    assert _stock_over(budget, 16518 * MIB, 16340 * MIB, "budget") is None
    assert _stock_over([budget, budget], 16518 * MIB, 16340 * MIB, "fit") is None


@pytest.mark.usefixtures("demo_installed")
def test_bench_stock_side_runs_the_unpatched_build_or_says_it_did_not(home: XdgHome, stock_build,
                                                                      patched_build) -> None:
    """Stock means stock: by default stock's llama-server is the unpatched build of the same pin (its id in
    the JSON, beside moeplug's); --stock-binary patched runs stock's flags on the patched build, and the
    JSON, a note and the builds line say so."""
    r = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert stock_build.manifest["stock"] and not patched_build.manifest["stock"]
    # (the homes reach the builds through a link: the same program by another path)
    binary = doc["stock_build"].pop("binary")
    assert doc["stock_build"] == {"build_id": stock_build.build_id, "patched": False}
    assert Path(binary).resolve() == stock_build.binary("llama-server").resolve()
    assert doc["sides"]["stock"]["build_id"] == stock_build.build_id and doc["sides"]["stock"]["binary"] == binary
    assert doc["sides"]["moeplug"]["build_id"] == patched_build.build_id
    same = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                   "--stock-binary", "patched", "--json")
    assert same.returncode == 0, same.stderr[-3000:]
    doc = json.loads(same.stdout)
    binary = doc["stock_build"].pop("binary")
    assert doc["stock_build"] == {"build_id": patched_build.build_id, "patched": True}
    assert Path(binary).resolve() == patched_build.binary("llama-server").resolve()
    assert any(n.startswith(f"stock's side ran the patched build {patched_build.build_id} with stock's flags")
               for n in doc["notes"])
    assert doc["sides"]["stock"]["args"][:6] == ["-c", "1024", "--fit", "on", "-fitt", "0"]
    text = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                   "--stock-binary", "patched")
    assert text.returncode == 0, text.stderr[-3000:]
    assert (f"stock ran the same patched build {patched_build.build_id} with stock's flags (--stock-binary patched), "
            f"not an unpatched llama.cpp") in text.stdout


@pytest.mark.usefixtures("demo_installed")
def test_bench_against_a_llama_server_of_the_users(home: XdgHome, stock_build, patched_build) -> None:
    """--against BIN: a llama-server the user has (here the stock build's, given by path) in stock's place,
    with the plan's -c and the user's flags: the same prompts, both sides timed, the other side named by
    its binary in the JSON and the text, nothing left running."""
    other = stock_build.binary("llama-server")
    r = moeplug(home, "bench", "demo", "--rounds", "2", "-n", "4", "--max-prompts", "2", "--prefill-reps", "1",
                "--against", str(other), "--against-args", "--fit on -t 2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["other"] == "against" and doc["other_label"] == str(other)
    assert doc["against"] == {"binary": str(other), "args": ["-c", "1024", "--fit", "on", "-t", "2"]}
    assert "stock_build" not in doc and set(doc["sides"]) == {"moeplug", "against"}
    theirs = doc["sides"]["against"]
    assert theirs["binary"] == str(other) and theirs["build_id"] is None and theirs["cache"] == [None, None]
    assert len(theirs["vram_bytes"]) == 2  # counted per launch as moeplug's are (None without a GPU)
    assert doc["sides"]["moeplug"]["build_id"] == patched_build.build_id
    text = doc["workloads"]["text"]
    assert text["prompts"] == 2
    for row in text["rows"]:
        for what in ("prefill", "decode"):
            d = row[what]
            assert d["moeplug_tps"] > 0 and d["against_tps"] > 0 and "stock_tps" not in d
            assert d["ratio"] == pytest.approx(d["moeplug_tps"] / d["against_tps"])
    assert set(text["per_round"]) == {"moeplug", "against"}
    assert f"round 1 of 2: {other}" in r.stderr
    # the user's server ran the flags given, and only those besides the model, host and port
    log = (Path(home["XDG_STATE_HOME"]) / "moeplug" / "logs" / "server-bench-demo-against.log").read_text(errors="replace")
    assert "n_threads = 2" in log
    out = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--prefill-reps", "1",
                  "--against", str(other))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"demo: moeplug's plan (no budget (no GPU)) against {other}, the same prompts" in out.stdout
    assert "prefill t/s moeplug / llama-server" in out.stdout and "of llama-server (median over 1 prompts)" in out.stdout
    assert f"builds: moeplug {patched_build.build_id}; against {other} (yours) with -c 1024" in out.stdout
    assert f"note: {other} ran with -c 1024 and none of -fitt, -ngl, -ncmoe, -ot, --cpu-moe or --moe-cache-mib" in out.stdout
    assert "CPU threads: moeplug llama.cpp's default, llama-server llama.cpp's default" in out.stdout
    # flags the user's server refuses: one line naming its log
    bad = moeplug(home, "bench", "demo", "--rounds", "1", "-n", "2", "--max-prompts", "1", "--against", str(other),
                  "--against-args", "--no-such-flag 3")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("moeplug: error: llama-server exited with code 1 while loading")
    assert "server-bench-demo-against.log" in bad.stderr
    status = moeplug(home, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["servers"] == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if line.startswith(str(other))]


def test_bench_against_bad_input_is_one_line(tmp_path: Path) -> None:
    """A BIN that is not there, a folder or not executable, flags a shell could not split, flags without
    --against or stock's options beside it: one line, before anything is read or launched (no model
    installed here)."""
    env = xdg_homes(tmp_path / "homes")
    plain = tmp_path / "llama-server.txt"
    plain.write_text("not a program\n")
    plain.chmod(0o644)
    executable = tmp_path / "llama-server"
    executable.write_text("#!/bin/sh\nexit 0\n")
    executable.chmod(0o755)
    for args, said in ((("--against", str(tmp_path / "none")), "no such file"),
                       (("--against", str(tmp_path)), "a folder, not a llama-server program"),
                       (("--against", str(plain)), "not executable"),
                       (("--against", str(executable), "--against-args", "--fit 'on"), "No closing quotation"),
                       (("--against", str(executable), "--against-args", "-m other.gguf -c 8"),
                        "-m: moeplug sets the model, host and port itself"),
                       (("--against-args", "--fit on"), "give --against BIN too"),
                       (("--against", str(executable), "--stock-binary", "patched"), "--stock-binary: the stock side's"),
                       (("--against", str(executable), "--stock-vram", "budget"), "--stock-vram budget: the stock side's")):
        r = moeplug(env, "bench", "demo", *args)
        assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = moeplug(env, "bench", "demo", "--stock-binary", "other")
    assert r.returncode == 2 and "--stock-binary" in r.stderr and "Traceback" not in r.stderr
