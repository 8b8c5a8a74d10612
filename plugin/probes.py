"""What this machine has free for the planner: RAM here (GPUs: moeplug.gpu, the one NVML probe)."""

from __future__ import annotations

from pathlib import Path


def available_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
