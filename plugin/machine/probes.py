"""What this machine has for the planner: RAM and CPU cores here (GPUs: moeplug.machine.gpu, the one NVML probe)."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path


def available_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def total_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str | None:
    """The CPU's model name as the kernel reports it ("AMD Ryzen 9 7950X 16-Core Processor"), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
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


def cpu_quota_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cores a CPU quota on this process's cgroup allows (a container's --cpus: cgroup v2's
    cpu.max, or v1's cfs quota and period), rounded up; None without a quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max": no quota
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def usable_cores() -> int | None:
    """The physical cores this process may run on, no more than its CPU quota allows: what the
    planner halves for the server's threads (plan.server_threads)."""
    cores, quota = physical_cores(), cpu_quota_cores()
    return min(cores, quota) if cores and quota else cores or quota


def wsl(version: Path = Path("/proc/version")) -> bool:
    """Whether this Linux runs under Microsoft's WSL (its kernel says so in /proc/version)."""
    try:
        text = version.read_text().lower()
    except OSError:
        return False
    return "microsoft" in text or "wsl" in text


# what llama.cpp logs where pinned host memory was refused and it fell back to pageable memory without a
# word more: ggml-vulkan's warnings, and ggml-cuda's line (logged only at debug verbosity)
PINNED_REFUSED = re.compile(r"Failed to allocate pinned memory|failed to allocate [\d.]+ Mi?B of pinned memory")


def pinned_refused(log_text: str) -> str | None:
    """The line of a server's log that says pinned host memory was refused, or None."""
    m = PINNED_REFUSED.search(log_text)
    if m is None:
        return None
    start = log_text.rfind("\n", 0, m.start()) + 1
    end = log_text.find("\n", m.end())
    return log_text[start:end if end >= 0 else None].strip()


def pinned_refusal_marker() -> Path:
    """Where serving.launch keeps the log line that showed pinned host memory refused on this machine."""
    from moeplug.core.paths import state_dir

    return state_dir() / "pinned-memory-refused"


def pinned_memory(marker: Path | None = None, version: Path = Path("/proc/version")) -> tuple[bool, str]:
    """Whether plans may rely on pinned host memory here, and the one line a plan says where not: not
    under WSL2 (it caps pinned memory near 1 GiB and llama.cpp then falls back to slow pageable buffers
    without a word), nor where a server's log showed it refused (`marker`: the line, kept by
    serving.launch)."""
    if wsl(version):
        return False, ("WSL2: pinned host memory is capped near 1 GiB, so the plan does not rely on it (experts "
                       "memory-mapped, no streamed misses)")
    if marker is not None and marker.is_file():
        line = marker.read_text().strip()
        return False, (f"a server's log showed pinned host memory refused ({line}), so the plan does not rely on "
                       f"it (experts memory-mapped, no streamed misses); remove {marker} to try it again")
    return True, ""
