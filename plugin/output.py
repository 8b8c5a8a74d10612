"""Printing for people (tables, sizes, progress bars) and for scripts (--json)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
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


class ProgressBar:
    """Progress on stderr: a bar on a terminal; elsewhere a line every `every` percent (0: none).

    The bar starts at the first update, when the total is known.
    """

    def __init__(self, description: str, unit: str = "it", every: int = 0) -> None:
        self.description, self.unit, self.every = description, unit, every
        self._bar: Any = None
        self._last_pct = -1

    def update(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=self.description, unit=self.unit, leave=False,
                                 unit_scale=self.unit == "B", unit_divisor=1024)
            self._bar.update(done - self._bar.n)
        elif self.every and total:
            pct = done * 100 // total
            if pct >= self._last_pct + self.every:
                note(f"  {self.description}: {pct}%")
                self._last_pct = pct

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def note(message: str) -> None:
    """A progress note for people, on stderr so that --json output stays clean."""
    print(message, file=sys.stderr, flush=True)
