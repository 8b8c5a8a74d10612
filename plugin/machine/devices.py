"""This machine's GPUs as llama.cpp itself lists them (`llama-server --list-devices`), for the GPUs NVML
does not see: AMD and Intel cards, or any card, through llama.cpp's Vulkan backend.

    Vulkan0: AMD Radeon RX 7600 (RADV NAVI33) (8176 MiB, 7962 MiB free)

Each device comes back as a GpuInfo (machine.gpu) with llama.cpp's name beside it, so that the planner
and status read one kind of record whichever probe found the GPU. llama.cpp's Vulkan backend leaves out
devices of the CPU type (Mesa's lavapipe, a software Vulkan driver) unless GGML_VK_VISIBLE_DEVICES
names them; where it lists no device at all, the first device is asked for by index, and the
environment that found it comes with the list, for the server that will use it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.machine.backend import Backend
from moeplug.machine.gpu import GpuInfo
from moeplug.machine.rpc import device_line

LIST_TIMEOUT_S = 60.0  # a Vulkan driver can take a while to compile its first pipelines
VISIBLE = "GGML_VK_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Listed:
    """The GPUs of one backend that llama.cpp lists, and the environment it listed them in."""

    backend: Backend
    gpus: list[GpuInfo]
    env: dict[str, str] = field(default_factory=dict)  # what the server needs to see the same devices
    software: bool = False  # a device the driver runs on the CPU (lavapipe), found only by naming it


def _run(server: Path, env: dict[str, str]) -> str:
    try:
        r = subprocess.run([str(server), "--list-devices"], capture_output=True, text=True, timeout=LIST_TIMEOUT_S,
                           env=os.environ | env)
    except subprocess.TimeoutExpired:
        raise MoeplugError(f"{server} --list-devices: no answer in {LIST_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise MoeplugError(f"{server}: cannot run ({exc.strerror or exc})") from None
    return r.stdout if r.returncode == 0 else ""


def parse_devices(text: str, backend: Backend) -> list[GpuInfo]:
    """The devices of `backend` in `--list-devices` output, in llama.cpp's order."""
    out = []
    for line in text.splitlines():
        d = device_line(line)
        if d is None or not d[0].startswith(backend.device_prefix) or not d[0][len(backend.device_prefix):].isdigit():
            continue
        name, description, total, free = d
        out.append(GpuInfo(len(out), description, total, max(total - free, 0), free, None, "", device=name))
    return out


def listed_gpus(server: Path, backend: Backend) -> Listed:
    """The GPUs of `backend` the llama-server `server` sees (none for the CPU backend). A Vulkan build
    that lists none asks for the first device by index (GGML_VK_VISIBLE_DEVICES=0): a software driver
    such as lavapipe, which llama.cpp lists only when named; a user's own GGML_VK_VISIBLE_DEVICES is
    left as it is."""
    if not backend.gpu:
        return Listed(backend, [])
    found = parse_devices(_run(server, {}), backend)
    if found or backend is not Backend.VULKAN or VISIBLE in os.environ:
        return Listed(backend, found)
    env = {VISIBLE: "0"}
    found = parse_devices(_run(server, env), backend)
    return Listed(backend, found, env if found else {}, software=bool(found))
