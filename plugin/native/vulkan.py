"""What a Vulkan build of llama.cpp needs on this machine, checked before anything is configured.

llama.cpp's ggml-vulkan compiles its shaders with glslc at build time and includes the Vulkan and
SPIR-V headers; its CMake stops with a page of output where one is missing. This says it in one
line, with the Debian/Ubuntu packages that bring each (a Vulkan SDK named by VULKAN_SDK is trusted
as it is). Running a Vulkan build needs a Vulkan driver too (the GPU's, or Mesa's lavapipe for the
CPU: mesa-vulkan-drivers); machine.devices says when llama.cpp finds none.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

INCLUDE_DIRS = (Path("/usr/include"), Path("/usr/local/include"))
# what each check needs, and the Debian package that brings it
NEEDS = (
    ("the Vulkan headers and loader", "vulkan/vulkan.h", "libvulkan-dev"),
    ("the SPIR-V headers", "spirv/unified1/spirv.hpp", "spirv-headers"),
    ("glslc", None, "glslc"),
)


def _has_header(rel: str) -> bool:
    return any((d / rel).is_file() for d in INCLUDE_DIRS)


def missing() -> list[tuple[str, str]]:
    """(what, Debian package) for each thing a Vulkan build needs and this machine lacks; [] where a
    Vulkan SDK is named (VULKAN_SDK) or everything is there."""
    if os.environ.get("VULKAN_SDK"):
        return []
    out = []
    for what, header, package in NEEDS:
        present = shutil.which("glslc") is not None if header is None else _has_header(header)
        if not present:
            out.append((what, package))
    return out


def missing_message(found: list[tuple[str, str]]) -> str:
    """The one line for what `missing` found."""
    what = ", ".join(w for w, _ in found)
    packages = " ".join(p for _, p in found)
    return (f"--vulkan: this machine lacks {what} (Debian/Ubuntu: apt-get install {packages}; "
            f"or a Vulkan SDK named by VULKAN_SDK)")


# Mesa's software Vulkan driver (lavapipe), which runs a Vulkan build on the CPU: what tests without a GPU use
LAVAPIPE_ICD_DIRS = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"))
LAVAPIPE_PACKAGE = "mesa-vulkan-drivers"


def has_lavapipe() -> bool:
    return any(d.is_dir() and any(d.glob("lvp_icd*.json")) for d in LAVAPIPE_ICD_DIRS)


def install_packages(packages: list[str], log: Path) -> None:
    """apt-get install Debian packages, as root where apt-get is (a fresh CI machine); a one-line error
    naming them elsewhere. The output goes to `log`."""
    import subprocess

    from moeplug.core.errors import MoeplugError

    if not packages:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise MoeplugError(f"missing Debian packages {' '.join(packages)}: apt-get install {' '.join(packages)} "
                           f"(as root)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    with open(log, "a") as out:
        for cmd in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900).returncode != 0:
                raise MoeplugError(f"{' '.join(cmd[:2])} {' '.join(packages)} failed (log: {log})")
