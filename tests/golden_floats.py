"""The floats of a committed golden JSON file, compared to a stated tolerance; everything else
compared exactly.

A modelled time or hit rate is a sum of many products, and its last bits depend on the CPU: numpy
picks its summation and its math kernels by the instruction set, and two CPUs can disagree in the
17th digit of the same plan. The rest of a golden document (integers such as slot counts and bytes,
booleans, strings such as flags and names, None, the keys of every object and the length of every
list) must be equal, and a float must stay a float.

Compared: the value computed now against the golden one (`differences`), within REL_TOL of the
larger of the two, or ABS_TOL near zero: millions of times a last bit (2.2e-16 of the value) and far
below what a change to the planner moves.
"""

from __future__ import annotations

import math
from typing import Any

REL_TOL = 1e-8
ABS_TOL = 1e-12  # near zero: a difference of two equal sums, 0.0 on one CPU and 1e-16 on another


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
