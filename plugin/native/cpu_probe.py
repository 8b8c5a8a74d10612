"""Checks of what this machine's CPU really runs, for a build native to it.

Some virtual machines advertise AMX in /proc/cpuinfo (so `-march=native` enables it) but fault
on the first tile instruction: llama.cpp then dies with SIGILL in its AMX kernels. We run a
tiny program once and, when it faults, build with AMX off.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

_AMX_PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA  18

struct tile_config {
    uint8_t  palette_id;
    uint8_t  start_row;
    uint8_t  reserved[14];
    uint16_t colsb[16];
    uint8_t  rows[16];
} __attribute__((packed, aligned(64)));

int main(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        return 1;
    }
    struct tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    cfg.colsb[0]   = 64;
    cfg.rows[0]    = 16;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""

NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def cpu_advertises_amx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " amx_tile" in line for line in text.splitlines())


def amx_works() -> bool:
    """True when AMX tile instructions run here (False if absent, unusable or not testable)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cpu_advertises_amx() or cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(_AMX_PROBE)
        if subprocess.run([cc, "-O1", "-mamx-tile", str(src), "-o", str(exe)], capture_output=True).returncode:
            return False
        return subprocess.run([str(exe)], capture_output=True).returncode == 0


def native_cpu_flags() -> tuple[str, ...]:
    """Extra compiler flags for a GGML_NATIVE build on this machine."""
    if cpu_advertises_amx() and not amx_works():
        return NO_AMX_FLAGS
    return ()
