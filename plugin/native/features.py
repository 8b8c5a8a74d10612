"""What a llama-server binary supports, read from its --help.

moeplug drives its own patched build first, and stock or other builds as a fallback; the
flags a binary lists say which of moeplug's strategies it can run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from moeplug.core.errors import MoeplugError

# feature name -> the flag that shows it
FEATURE_FLAGS: dict[str, str] = {
    "moe_cache_profile": "--moe-cache-profile",  # moeplug's slot cache
    "moe_cache_slots": "--moe-cache-slots",
    "moe_cache_max_batch": "--moe-cache-max-batch",
    "moe_cache_mib": "--moe-cache-mib",  # upstream's later dynamic cache
    "cpu_moe": "--cpu-moe",
    "n_cpu_moe": "--n-cpu-moe",
    "override_tensor": "--override-tensor",
    "fit": "--fit",
    "load_mode": "--load-mode",
    "repack": "--repack",
    "metrics": "--metrics",
    "moe_cache_record": "--moe-cache-record",  # routing counts at /moe-cache/profile (moeplug reprofile)
}


def detect_features(binary: Path, timeout: float = 60) -> dict[str, bool]:
    if not binary.exists():
        raise MoeplugError(f"{binary}: no such file")
    if not os.access(binary, os.X_OK):
        raise MoeplugError(f"{binary}: not executable")
    try:
        proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MoeplugError(f"{binary}: could not run --help ({exc})") from exc
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 or "--model" not in text:
        raise MoeplugError(f"{binary}: --help failed (exit {proc.returncode}); not a llama.cpp server?")
    words = set(text.replace(",", " ").split())
    return {name: flag in words for name, flag in FEATURE_FLAGS.items()}
