"""A short, stable name for this machine as the planner's costs see it: its GPUs, its CPU, its RAM and
the native build that runs the model.

A calibration (moeplug.operations.calibrate) holds for one fingerprint: a new GPU, a new driver, a
card moved to a narrower slot, another CPU or core count (a container's quota or `taskset` included),
more or less RAM, or another build gives another fingerprint, and so a new calibration.

    machine_identity() -> dict          what goes in: {"gpus": [...], "cpu": {...}, "ram_gib": int}
    machine_fingerprint(build_id) -> (str, dict)
                                        12 hex digits of the identity and the build id, and the identity
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from moeplug.machine.gpu import gpu_identities
from moeplug.machine.probes import cpu_model, total_ram_bytes, usable_cores

GIB = 1 << 30


def machine_identity() -> dict[str, Any]:
    """The GPUs (moeplug.machine.gpu.gpu_identities), the CPU (model, the physical cores this process
    may use) and the RAM (GiB, rounded: the kernel's figure moves by a few MiB between boots)."""
    ram = total_ram_bytes()
    return {"gpus": gpu_identities(),
            "cpu": {"model": cpu_model(), "cores": usable_cores()},
            "ram_gib": round(ram / GIB) if ram else None}


def fingerprint_of(identity: dict[str, Any], build_id: str) -> str:
    text = json.dumps({"machine": identity, "build": build_id}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def machine_fingerprint(build_id: str) -> tuple[str, dict[str, Any]]:
    """This machine's fingerprint with the build `build_id`, and the identity it was made from."""
    identity = machine_identity()
    return fingerprint_of(identity, build_id), identity
