"""What this machine has free for the planner: RAM here (GPUs: moeplug.gpu, the one NVML probe)."""

from __future__ import annotations

import os
from pathlib import Path


def available_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def physical_cores() -> int | None:
    """The physical cores this process may run on (hyperthread siblings counted once, as llama.cpp
    counts them for its default thread count), or None where the topology cannot be read."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = list(range(os.cpu_count() or 0))
    cores = set()
    for cpu in allowed:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return len(allowed) or None
    return len(cores) or None
