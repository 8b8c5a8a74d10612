"""The one NVML probe: what NVIDIA GPUs this machine has, and how full they are (GPUs NVML does not
see: machine.devices, as llama.cpp lists them).

Every caller (the planner, the native build, `moeplug status`, the dashboard) reads GPUs
through here, so "no GPU" means the same thing everywhere: no NVML library, no driver or no
device all give an empty list, never an exception.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from moeplug.core.errors import EXIT_USAGE, MoeplugError

MAX_PLANNED_GPUS = 2  # the planner splits layers over one or two GPUs


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization: int | None  # percent, None where the driver does not say
    compute_capability: str  # CMake form, "90" ('' for a GPU llama.cpp listed: machine.devices)
    device: str = ""  # llama.cpp's name where llama.cpp listed it (Vulkan0; machine.devices), '' from NVML

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _per_gpu(read: Callable[[Any, Any, int], Any]) -> list[Any]:
    """read(pynvml, handle, index) for every NVIDIA GPU NVML sees, in index order; [] without an NVIDIA
    GPU (no library, no driver) or where NVML fails."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: no GPU
        return []
    try:
        return [read(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i), i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpus() -> list[GpuInfo]:
    """Every NVIDIA GPU NVML sees, in index order; [] without an NVIDIA GPU."""
    def read(nvml: Any, h: Any, i: int) -> GpuInfo:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        util = _nvml_or_none(lambda handle: nvml.nvmlDeviceGetUtilizationRates(handle).gpu, h)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
        return GpuInfo(i, _text(nvml.nvmlDeviceGetName(h)), int(mem.total), int(mem.used), int(mem.free), util,
                       f"{major}{minor}")

    return _per_gpu(read)


def gpu_identities() -> list[dict[str, Any]]:
    """What makes each NVIDIA GPU the card it is, for a machine's fingerprint (machine.fingerprint):
    name, total memory, the PCIe link's generation and width and the driver, in index order; [] without
    an NVIDIA GPU. The link's figures are the most the card and this slot allow (NVML's max link
    generation and width), not the current ones, which drop while the card idles; None where NVML
    does not say (an SXM card, a virtual GPU)."""
    def read(nvml: Any, h: Any, i: int) -> dict[str, Any]:
        return {"name": _text(nvml.nvmlDeviceGetName(h)), "memory_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                "pcie_gen": _nvml_or_none(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "pcie_width": _nvml_or_none(nvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                "driver": _text(nvml.nvmlSystemGetDriverVersion())}

    return _per_gpu(read)


def _nvml_or_none(query: Any, handle: Any) -> int | None:
    try:
        return int(query(handle))
    except Exception:
        return None


def free_vram_bytes() -> int | None:
    """Free memory of GPU 0, or None without an NVIDIA GPU."""
    found = gpus()
    return found[0].free_bytes if found else None


def vram_budgets(budget: int | list[int] | None, found: list[GpuInfo]) -> int | list[int] | None:
    """The budget to plan for: one size (one GPU, as given), one per GPU (a list, checked against
    the GPUs found: no more budgets than GPUs where NVML sees any), or None: each GPU's free memory
    (an int with one GPU, a list with two or more: the first two), None without a GPU."""
    if isinstance(budget, list):
        if found and len(budget) > len(found):
            raise MoeplugError(f"--vram-budget gives {len(budget)} budgets but this machine has {len(found)} "
                               f"NVIDIA GPU{'s' if len(found) != 1 else ''}: give one per GPU", EXIT_USAGE)
        return budget
    if budget is not None:
        return budget
    free = [g.free_bytes for g in found[:MAX_PLANNED_GPUS]]
    return None if not free else free[0] if len(free) == 1 else free


def one_budget_note(budget: int | list[int] | None, found: list[GpuInfo]) -> str | None:
    """What a plan of one budget should say on a machine with more GPUs (None: nothing)."""
    if budget is None or isinstance(budget, list) or len(found) < 2:
        return None
    return (f"one budget for {len(found)} GPUs: planned as one GPU, but llama.cpp spreads the layers over every "
            f"GPU it sees (by free memory); give one budget per GPU (--vram-budget A,B) to plan the split")


def gpu_arch() -> str | None:
    """GPU 0's compute capability as a CMake architecture ("90"), or None."""
    found = gpus()
    return found[0].compute_capability if found else None


def process_vram_bytes(pid: int) -> int | None:
    """GPU memory the process `pid` holds on every NVIDIA GPU together (NVML's per-process
    accounting), or None without an NVIDIA GPU or where NVML does not list the process (another
    PID namespace)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        total, found = 0, False
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    total, found = total + int(proc.usedGpuMemory), True
        return total if found else None
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
