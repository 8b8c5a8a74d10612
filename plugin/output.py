"""Printing for people (tables, sizes, progress bars) and for scripts (--json)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain text table; `align` has one 'l' or 'r' per column (default: numbers right)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if align is None:
        align = "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l" for i in range(len(headers)))

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def progress_bar(description: str, total: int, unit: str = "B") -> tuple[Callable[[int], None], Callable[[], None]]:
    """(update(done), close()) for a bar on stderr; silent when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return (lambda done: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=description, unit=unit, unit_scale=True, unit_divisor=1024, leave=False)

    def update(done: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close


def note(message: str) -> None:
    """A progress note for people, on stderr so that --json output stays clean."""
    print(message, file=sys.stderr, flush=True)
