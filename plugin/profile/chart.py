"""A small terminal chart of the coverage curve: hit rate against slots per layer."""

from __future__ import annotations

SYMBOLS = {"static": "S", "oracle": "O", "lru": "L"}


def symbol(policy: str) -> str:
    return SYMBOLS.get(policy, "R")


def coverage_chart(slots: list[int], curves: dict[str, list[float | None]], height: int = 10,
                   col_width: int = 5) -> str:
    """One column per slot count, one row per 10% of hit rate; a letter per policy."""
    grid = [[" " * col_width for _ in slots] for _ in range(height + 1)]
    for policy, values in curves.items():
        for x, v in enumerate(values):
            if v is None:
                continue
            y = round(v * height)
            cell = grid[y][x].strip()
            mark = symbol(policy) if not cell else "*"
            grid[y][x] = mark.center(col_width)
    lines = []
    for y in range(height, -1, -1):
        label = f"{100 * y // height:3d}% |" if y % 2 == 0 else "     |"
        lines.append(label + "".join(grid[y]).rstrip())
    lines.append("     +" + "-" * (col_width * len(slots)))
    lines.append("      " + "".join(str(n).center(col_width) for n in slots) + "  slots per layer")
    legend = "  ".join(f"{symbol(p)} {p}" for p in curves) + "  (* several)"
    lines.append("      " + legend)
    return "\n".join(lines)
