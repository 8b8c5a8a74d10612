"""The floats of a committed golden JSON file: written to SIGNIFICANT significant digits and compared
to a stated tolerance, everything else compared exactly.

A modelled time or hit rate is a sum of many products, and its last bits depend on the CPU: numpy
picks its summation and its math kernels by the instruction set, and two CPUs can disagree in the
17th digit of the same plan. Those digits are not written, and no comparison sees them. The rest of
a golden document (integers such as slot counts and bytes, booleans, strings such as flags and
names, None, the keys of every object and the length of every list) must be equal, and a float must
stay a float.

Written: every float rounded to SIGNIFICANT significant digits (`rounded`). Compared: the value
computed now, unrounded, against the written one (`differences`), within REL_TOL of the larger of
the two, or ABS_TOL near zero. REL_TOL is at least one unit in the last written digit: at most half
of it is taken by the rounding when the file was written, the rest (5e-9 of the value or more) is
room for the arithmetic, millions of times a last bit (2.2e-16 of the value) and far below what a
change to the planner moves.
"""

from __future__ import annotations

import math
from typing import Any

SIGNIFICANT = 9
REL_TOL = 10.0 ** (1 - SIGNIFICANT)
ABS_TOL = 1e-12  # near zero: a difference of two equal sums, 0.0 on one CPU and 1e-16 on another


def rounded(doc: Any) -> Any:
    """doc (parsed JSON) with every float rounded to SIGNIFICANT significant digits."""
    if isinstance(doc, float):
        return float(f"{doc:.{SIGNIFICANT}g}") if math.isfinite(doc) else doc
    if isinstance(doc, list):
        return [rounded(v) for v in doc]
    if isinstance(doc, dict):
        return {k: rounded(v) for k, v in doc.items()}
    return doc


def same_float(golden: float, now: float) -> bool:
    """Whether a float computed now is the golden one to the stated tolerance."""
    if math.isnan(golden) or math.isnan(now):
        return math.isnan(golden) and math.isnan(now)
    return math.isclose(golden, now, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def differences(golden: Any, now: Any, where: str = "") -> list[str]:
    """Each place where the document computed now differs from the golden one (both parsed JSON),
    as 'PATH: golden G, now N'; empty where they are the same."""
    here = where or "the document"
    if type(golden) is not type(now):
        return [f"{here}: golden {golden!r} ({type(golden).__name__}), now {now!r} ({type(now).__name__})"]
    if isinstance(golden, float):
        return [] if same_float(golden, now) else [f"{here}: golden {golden!r}, now {now!r}"]
    if isinstance(golden, list):
        if len(golden) != len(now):
            return [f"{here}: golden {len(golden)} items, now {len(now)}: golden {golden!r}, now {now!r}"]
        return [d for i, (g, n) in enumerate(zip(golden, now)) for d in differences(g, n, f"{where}[{i}]")]
    if isinstance(golden, dict):
        found = [f"{where}.{k}".lstrip(".") + ": golden has it, now missing" for k in golden if k not in now]
        found += [f"{where}.{k}".lstrip(".") + ": new, not in golden" for k in now if k not in golden]
        for key in golden:
            if key in now:
                found += differences(golden[key], now[key], f"{where}.{key}".lstrip("."))
        return found
    return [] if golden == now else [f"{here}: golden {golden!r}, now {now!r}"]
