"""The GPU benchmark's bookkeeping, run against a real llama-bench (the CPU build) on a real model:
the table's figures are medians of every repetition of every round, and each ratio divides two
of them from the same run."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "native" / "bench" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moeplug_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_rounds_pool_every_repetition_and_ratios_divide_medians(
        bench, patched_build, fixture_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    binary = patched_build.binary("llama-bench")
    model = fixture_models["qwen3moe"]
    stock = bench.Row("8 GiB", "stock", ["-t", "2"], True)
    other = bench.Row("8 GiB", "one thread", ["-t", "1"], False, ["-t", "1", "-ub", "64"])
    rows = [stock, other]
    bench.run_rounds(rows, lambda row: binary, model, ["mmap", "pinned"], 2, 32, 8, 3, 3)
    # each load mode's second round runs the rows in reverse
    runs = re.findall(r"^#\s+8 GiB (stock|one thread)\s+(mmap|pinned) ", capsys.readouterr().err,
                      re.MULTILINE)
    forward = [("stock", "mmap"), ("one thread", "mmap")]
    backward = forward[::-1]
    assert runs == forward + backward + [(c, "pinned") for c, _ in forward + backward], runs
    for row in rows:
        for test in ("pp", "tg"):
            for load in ("mmap", "pinned"):
                values = row.samples[test, load]
                kept = 2 if test == "pp" else 3  # the first prefill repetition of a run is a warm-up
                assert len(values) == 2 * kept and all(v > 0 for v in values), (row.config, test, load, values)
                assert row.runs[test, load] == [values[:kept], values[kept:]]  # one list per round
    capsys.readouterr()
    bench.print_table(rows, 32, 8)
    table = capsys.readouterr().out
    lines = [line for line in table.splitlines() if line.startswith("| 8 GiB")]
    assert len(lines) == 2
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    for row, cell in zip(rows, cells):
        for test, column in (("pp", 3), ("tg", 4)):
            load, values = row.best(test)
            assert values == max((row.samples[test, m] for m in ("mmap", "pinned")), key=statistics.median)
            assert cell[column].startswith(f"{statistics.median(values):.1f} ± ")
    for test, column, ratio_column in (("pp", 3, 5), ("tg", 4, 6)):
        assert cells[0][ratio_column] == "1.00x"  # the only stock row is its own best
        m = re.fullmatch(r"(\d+\.\d\d)x \((\d+\.\d\d)-(\d+\.\d\d)\)", cells[1][ratio_column])
        assert m, cells[1][ratio_column]
        # the ratio of the medians (the printed t/s are rounded to 0.1, too coarse for a slow row)
        assert abs(float(m[1]) - statistics.median(other.best(test)[1]) / statistics.median(stock.best(test)[1])) <= 0.006
        # the range is that of the rounds' own ratios, each round's runs paired with each other
        per_round = [statistics.median(a) / statistics.median(b) for a, b in
                     zip(other.runs[test, other.best(test)[0]], stock.runs[test, stock.best(test)[0]])]
        assert len(per_round) == 2
        assert (float(m[2]), float(m[3])) == (round(min(per_round), 2), round(max(per_round), 2))
    assert "lowest and highest ratio of single rounds" in table


def test_first_prefill_repetition_of_a_run_is_dropped_as_a_warm_up(
        bench, patched_build, fixture_models: dict[str, Path]) -> None:
    cmd = [str(patched_build.binary("llama-bench")), "-m", str(fixture_models["qwen3moe"]),
           "-p", "32", "-n", "4", "-r", "3", "-t", "2", "-o", "json"]
    results = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    raw = {("pp" if x["n_prompt"] else "tg"): x["samples_ts"] for x in results}
    assert len(raw["pp"]) == len(raw["tg"]) == 3
    assert bench._samples(results, prefill=True) == raw["pp"][1:]
    assert bench._samples(results, prefill=False) == raw["tg"]


def test_no_round_starts_that_would_pass_the_time_limit(
        bench, patched_build, fixture_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Past the deadline every row stops after the same round (rounds pair the rows' runs); with time
    left for the next round at the last one's pace, all of them run."""
    binary = patched_build.binary("llama-bench")
    model = fixture_models["qwen3moe"]
    rows = [bench.Row("8 GiB", "stock", ["-t", "2"], True), bench.Row("8 GiB", "other", ["-t", "1"], False)]
    bench.run_rounds(rows, lambda row: binary, model, ["mmap"], 3, 16, 0, 1, 2, deadline=time.time())
    assert [len(row.runs["pp", "mmap"]) for row in rows] == [1, 1]
    assert "mmap: 1 of 3 rounds, another would pass the time limit" in capsys.readouterr().err
    rows = [bench.Row("8 GiB", "stock", ["-t", "2"], True)]
    bench.run_rounds(rows, lambda row: binary, model, ["mmap"], 2, 16, 0, 1, 2, deadline=time.time() + 600)
    assert len(rows[0].runs["pp", "mmap"]) == 2
