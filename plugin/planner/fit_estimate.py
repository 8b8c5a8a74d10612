"""llama.cpp's own estimate of what a server puts on the GPU beside the routed experts.

`llama-fit-params --fit-print on` (the tool behind stock `--fit`) loads the model's header and
builds its graphs without allocating, and prints per device the MiB of weights, context (KV cache)
and compute buffers the same command line would allocate. Asked with every routed expert in RAM
(`-ngl 99 --cpu-moe`), that is the VRAM the server needs before any expert: the planner gives the
experts what the budget leaves beside it and the CUDA context, which no buffer counts. Stock
`--fit` sizes its own placement from the same numbers, so the two fill a budget alike.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

from moeplug.core.sizes import MIB



@dataclass(frozen=True)
class DeviceNeed:
    device: str  # e.g. CUDA0
    model: int  # bytes of weights
    context: int  # KV cache and other context buffers
    compute: int  # graph scratch

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute


def parse_fit_print(text: str) -> list[DeviceNeed]:
    """The device lines of `--fit-print on` output ('CUDA0 1234 96 310', MiB); the Host line is not a device."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] != "Host" and all(p.isdigit() for p in parts[1:]):
            model, context, compute = (int(p) * MIB for p in parts[1:])
            out.append(DeviceNeed(parts[0], model, context, compute))
    return out


def gpu_need(fit_tool: Path, model: Path, ctx: int, extra_args: list[str] | None = None,
             timeout: float = 300, experts_in_ram: bool = True) -> DeviceNeed | None:
    """What the first GPU holds for a server of this model and context with every routed expert in
    RAM (experts_in_ram False: every weight on the GPU, as a speculative draft model is loaded), by
    llama.cpp's own estimate; None when the tool is missing, fails or finds no GPU. Asked once per
    process for the same tool, model file and context (the dashboard re-plans often)."""
    if not fit_tool.exists() or not Path(model).exists():
        return None
    stamp = tuple((p.stat().st_mtime_ns, p.stat().st_size) for p in (fit_tool, Path(model)))
    extra = (("--cpu-moe",) if experts_in_ram else ()) + tuple(extra_args or ())
    return _gpu_need(fit_tool, Path(model), ctx, extra, timeout, stamp)


@functools.lru_cache(maxsize=32)
def _gpu_need(fit_tool: Path, model: Path, ctx: int, extra_args: tuple[str, ...], timeout: float,
              stamp: tuple[tuple[int, int], ...]) -> DeviceNeed | None:
    """gpu_need's run of the tool; stamp (the files' mtime and size) only keys the cache."""
    try:
        r = subprocess.run([str(fit_tool), "-m", str(model), "-c", str(ctx), "-ngl", "99",
                            "--fit-print", "on", *extra_args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    devices = parse_fit_print(r.stdout)
    return devices[0] if devices else None
