"""Print README.md's speed table from the runs kept in native/bench/results/.

Every figure comes from a run's JSON (serve_bench.py's `--json`, or `moeplug bench --json`), so the
table says nothing that no committed file holds. Each row names its run, the rounds and prompts, the
build and flags the stock side ran, and what moeplug ran beyond its plan's flags.

    python native/bench/speed_table.py            # the table, as README.md holds it
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Row:
    """One line of the table: where its figures are and which row of that run's table they are."""

    what: str
    path: str  # under results/
    workload: str
    budget: str = ""  # serve_bench rows: the table row's budget, as printed
    moeplug: str = ""  # serve_bench rows: the table row's moeplug description, as printed
    stock: str = "--fit"  # serve_bench rows: the table row's stock description


ROWS = [
    Row("gpt-oss-20b shape, real routing (trace replay)", "2026-12-02-new-prompt-prefill/call3-goss-25-50.json",
        "replay", budget="25% (5.88 GiB)", moeplug="4-10 of 32 per layer, stream 0.75"),
    Row("the same", "2026-12-02-new-prompt-prefill/call3-goss-25-50.json",
        "replay", budget="50% (8.25 GiB)", moeplug="8-20 of 32 per layer"),
    Row("Qwen3-30B-A3B shape, the text it was profiled on", "2026-12-02-new-prompt-prefill/call1-qwen3-8-policies.json",
        "text-profiled", budget="8 GiB", moeplug="21-128 of 128 per layer (2 whole layers), dynamic"),
    Row("Qwen3-30B-A3B shape, text profiling never saw, on an H100", "2026-12-07-engine-move-h100/unpatched-stock/row-unpatched.json",
        "text-unseen", budget="12 GiB", moeplug="24-128 of 128 per layer (22 whole layers)"),
    Row("the same text on the H200", "2026-12-02-new-prompt-prefill/call2-qwen3-12-16.json",
        "text-unseen", budget="16 GiB", moeplug="35-128 of 128 per layer (42 whole layers), no copies ahead"),
    Row("`moeplug install` from a fresh home on an H100, then `moeplug bench` (Qwen3 shape, held-out text)",
        "2026-12-07-install-chooses-h100/bench-12gib/bench.json", "text"),
    Row("Qwen3-30B-A3B shape, 4096-token prompts, the batch the planner chose", "2026-12-04-long-prompt-plans/call2-qwen3-weight10.json",
        "random", budget="12 GiB", moeplug="28-128 of 128 per layer (16 whole layers), -ub auto=2048, prompts of 4096 planned for"),
    Row("Qwen3-30B-A3B shape, 12-token prompts", "2026-12-04-short-prompts-flag/flag-12-tokens/a.json",
        "random", budget="12 GiB", moeplug="35-128 of 128 per layer (19 whole layers)"),
    Row("`moeplug bench --chat` after `moeplug install`, chat turns (Qwen3 shape)",
        "2026-12-04-chat-opening-turns/product-12gib/bench.json", "chat"),
    Row("the same", "2026-12-04-chat-opening-turns/product-16gib/bench.json", "chat"),
]


class TableError(Exception):
    pass


def _ratio(entry: dict) -> str:
    return f"{entry['ratio_median']:.2f}x ({entry['ratio_lowest']:.2f}x)"


def _flags(args: list[str]) -> str:
    """Stock's flags as they bear on speed: the fit, load mode, parallel slots, batch, threads."""
    keep, skip = [], {"-c", "-fitt", "--moe-route-replay"}
    i = 0
    while i < len(args):
        a = str(args[i])
        if a in skip:
            i += 2
            continue
        keep.append(a)
        i += 1
    text = "`" + " ".join(keep) + "`"
    return text + ("" if "-t" in keep else ", default threads")


def _build(binary: str) -> str:
    return "patched build" if "-moeplug-" in binary else "unpatched build"


def _load(path: str) -> dict:
    file = RESULTS / path
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise TableError(f"no such run output: {file}") from None
    except json.JSONDecodeError as e:
        raise TableError(f"{file}: not JSON ({e.msg}, line {e.lineno})") from None


def _serve_bench_row(row: Row, data: dict) -> tuple[str, str, str, str]:
    table = [t for t in data.get("tables", {}).get(row.workload, [])
             if t.get("budget") == row.budget and t.get("moeplug") == row.moeplug and t.get("stock") == row.stock]
    if len(table) != 1:
        raise TableError(f"{row.path}: {len(table)} rows of {row.workload} match {row.budget} / {row.moeplug!r}")
    t = table[0]
    def serves(c: dict, side: str, desc: str) -> bool:
        return (c["side"] == side and c["budget"] == row.budget and c.get("desc") == desc
                and any(row.workload.startswith(w) for w in c.get("workloads", [])))

    stock = [c for c in data["configs"] if serves(c, "stock", row.stock)]
    moeplug = [c for c in data["configs"] if serves(c, "moeplug", row.moeplug)]
    if not stock or not moeplug:
        raise TableError(f"{row.path}: no server configuration for {row.budget}")
    rounds = max(len(v) for c in stock for v in c["samples"].values())
    conditions = (f"{rounds} rounds, {t['prompts']} prompts; stock: {_build(stock[0]['binary'])}, "
                  f"{_flags(stock[0]['server_args'])}; moeplug: the plan ({t['moeplug']})")
    return row.budget, _ratio(t["prefill"]), _ratio(t["decode"]), conditions


def _moeplug_bench_row(row: Row, data: dict) -> tuple[str, str, str, str]:
    w = data.get("workloads", {}).get(row.workload)
    if not w:
        raise TableError(f"{row.path}: no {row.workload} workload")
    budget = f"{data['budget_bytes'] / 2**30:g} GiB"
    stock = data["sides"]["stock"]
    extra = " ".join(f"{k}={v}" for k, v in (data["sides"]["moeplug"].get("env") or {}).items())
    # runs before bench recorded its stock side's build ran stock's flags on moeplug's own build
    build = (_build(stock["binary"]) if stock.get("binary") else "patched build") + \
        (" (moeplug's own)" if not stock.get("binary") or "-moeplug-" in stock["binary"] else "")
    what = "turns" if row.workload == "chat" else "prompts"
    conditions = (f"{data['rounds']} rounds, {len(w['rows'])} {what}; stock: {build}, "
                  f"{_flags(stock['args'])}; moeplug: the installed plan{', ' + extra if extra else ''}")
    return budget, _ratio(w["prefill"]), _ratio(w["decode"]), conditions


def table() -> str:
    lines = ["| workload | budget | prefill vs stock (lowest) | decode vs stock (lowest) | conditions | run |",
             "|---|---|---:|---:|---|---|"]
    for row in ROWS:
        data = _load(row.path)
        cells = _moeplug_bench_row(row, data) if "sides" in data else _serve_bench_row(row, data)
        run = row.path.split("/")[0]
        lines.append(f"| {row.what} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | `{run}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    if argv if argv is not None else sys.argv[1:]:
        print("speed_table.py takes no arguments", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(table())
    except TableError as e:
        print(f"speed_table.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
