"""The bus between RAM and GPU 0, measured: host-to-device copies from pinned memory through the CUDA
runtime (libcudart, loaded with ctypes: no Python CUDA package needed).

    h2d_bytes_per_s(lib_dirs, size, copies) -> (float | None, str | None)
        the median rate of `copies` copies of `size` bytes, or None and why not

It is the rate the expert cache's uploads and stock's prompt path can reach at best; what llama.cpp
gets in a real prompt batch is measured apart (moeplug.operations.calibrate).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

CUDA_MEMCPY_HOST_TO_DEVICE = 1
DEFAULT_SIZE = 256 << 20
DEFAULT_COPIES = 8


def _cudart_candidates(lib_dirs: Iterable[Path]) -> list[str]:
    found: list[str] = []
    for d in lib_dirs:
        found += sorted(glob.glob(str(Path(d) / "libcudart.so*")), reverse=True)
    if name := ctypes.util.find_library("cudart"):
        found.append(name)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for d in (Path(cuda_home) / "lib64", Path("/usr/local/cuda/lib64"), Path("/usr/lib/x86_64-linux-gnu")):
        found += sorted(glob.glob(str(d / "libcudart.so*")), reverse=True)
    return list(dict.fromkeys(found))


def load_cudart(lib_dirs: Iterable[Path] = ()) -> ctypes.CDLL | None:
    """The CUDA runtime library: from `lib_dirs` first (a CUDA build's bin/), then the system's."""
    for candidate in _cudart_candidates(lib_dirs):
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


def h2d_bytes_per_s(lib_dirs: Iterable[Path] = (), size: int = DEFAULT_SIZE,
                    copies: int = DEFAULT_COPIES) -> tuple[float | None, str | None]:
    """Copies of `size` bytes from pinned host memory (cudaMallocHost) to GPU 0 (cudaMalloc), each
    timed alone after one untimed copy: (the median rate in bytes/s, None), or (None, why not)."""
    cudart = load_cudart(lib_dirs)
    if cudart is None:
        return None, "no CUDA runtime library (libcudart) found"
    host, dev = ctypes.c_void_p(), ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed (CUDA error {rc})")

    try:
        check(cudart.cudaSetDevice(0), "cudaSetDevice")
        check(cudart.cudaMallocHost(ctypes.byref(host), ctypes.c_size_t(size)), "cudaMallocHost")
        check(cudart.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(size)), "cudaMalloc")
        ctypes.memset(host, 1, size)  # touch every page before timing
        seconds = []
        for i in range(copies + 1):
            t0 = time.perf_counter()
            check(cudart.cudaMemcpy(dev, host, ctypes.c_size_t(size), CUDA_MEMCPY_HOST_TO_DEVICE), "cudaMemcpy")
            check(cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            if i:  # the first copy warms the path up
                seconds.append(time.perf_counter() - t0)
        return size / statistics.median(seconds), None
    except RuntimeError as exc:
        return None, str(exc)
    finally:
        if dev.value:
            cudart.cudaFree(dev)
        if host.value:
            cudart.cudaFreeHost(host)
