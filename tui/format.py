"""Text for the dashboard's cells: durations, rates, sizes, bars (no Textual here)."""

from __future__ import annotations

from moeplug.core.output import human_bytes

STRIP = " ▁▂▃▄▅▆▇█"


def duration(seconds: float | None) -> str:
    """'42s', '3m05s', '2h07m', '3d04h'."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def rate(x: float | None) -> str:
    return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f}"


def size(n: float | None) -> str:
    return "-" if n is None else human_bytes(n)


def bar(value: float, total: float, width: int, marker: float | None = None) -> str:
    """A bar of `width` cells, `value` of `total` filled; `marker` (same unit) drawn as a ┃."""
    if total <= 0 or width <= 0:
        return " " * max(width, 0)
    filled = round(width * min(max(value / total, 0.0), 1.0))
    cells = ["█"] * filled + ["░"] * (width - filled)
    if marker is not None and 0 <= marker <= total:
        cells[min(width - 1, int(width * marker / total))] = "┃"
    return "".join(cells)


def strip(values: list[float | None]) -> str:
    """One cell per value in 0..1 (None: a dot), for hit rates over layers."""
    return "".join("·" if v is None else STRIP[min(len(STRIP) - 1, round(v * (len(STRIP) - 1)))] for v in values)
