"""Byte sizes as people write them ("12GiB", "8000MiB") and the units the planner counts in."""

from __future__ import annotations

import re

from moeplug.core.errors import MoeplugError

MIB = 1 << 20
GIB = 1 << 30

_SIZE_RE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": MIB, "G": GIB, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'12GiB', '12G', '12 GB' (binary units, as GPU tools report them) or bytes."""
    m = _SIZE_RE.match(text)
    try:
        number = float(m[1]) if m else None
    except ValueError:  # "1.2.3"
        number = None
    if number is None or m is None:
        raise MoeplugError(f"'{text}' is not a size (use e.g. 12GiB or 8000MiB)")
    return int(number * _UNITS[(m[2] or "").upper()[:1]])
