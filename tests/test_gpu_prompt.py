"""Prompt batches with the expert slot cache on a GPU (skipped without one): the slots in VRAM, the
other experts in pinned RAM, a batch of 32 tokens or more runs the stock pass and the GPU copies
each expert it uses from its slot or over the bus (patches 0018-0020; a layer's gate and down experts
on a second stream while the matmul before computes, 0021-0022). Its logits must be bitwise
those of the same placement without the cache, where the scheduler copies every used expert from
RAM: the same offload, the same kernels, the same bytes.

    MOEPLUG_GPU_BIN=<bin/ of a patched CUDA build> pytest tests/test_gpu_prompt.py

The CPU build cannot reach this path (nothing is offloaded), so CI skips it; native/BENCHMARKS.md
has the H200 runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import Prebuilt, make_profile

GPU_BIN = os.environ.get("MOEPLUG_GPU_BIN")

pytestmark = [pytest.mark.native,
              pytest.mark.skipif(not GPU_BIN, reason="needs MOEPLUG_GPU_BIN, the bin/ of a patched CUDA build")]

ENGAGED = "prompt batches in one pass on"
DYNAMIC = ("--moe-cache-policy", "dynamic", "--moe-cache-half-life", "32", "--moe-cache-uploads", "8")


@pytest.fixture(scope="module")
def gpu_build() -> Prebuilt:
    build = Prebuilt(Path(GPU_BIN or "."))
    assert build.binary("test-moe-cache").is_file(), f"no test-moe-cache in {build.bin_dir}"
    return build


@pytest.mark.parametrize("policy", ["static", "dynamic"])
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss", "hy_v3"])
def test_prompt_batches_copy_the_slots_and_equal_stock(gpu_build, fixture_models, tmp_path: Path, name: str,
                                                       policy: str) -> None:
    model = fixture_models[name]
    profile = make_profile(gpu_build, model, tmp_path / "p.gguf", 16)
    cmd = [str(gpu_build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile", str(profile),
           "--moe-cache-slots", "3", "--moe-cache-max-batch", "512", "-ngl", "99", "--cpu-moe", "-lm", "none",
           "-ub", "100", "-n", "0", *(DYNAMIC if policy == "dynamic" else ())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert ENGAGED in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_short_prompt_batches_go_to_the_gpu_from_the_flags_threshold(gpu_build, fixture_models, tmp_path: Path,
                                                                      name: str) -> None:
    """--moe-cache-offload-min-batch 8 (patch 0025): batches of 10 tokens (the test's 100 prompt tokens in ten) take the one-pass path on the
    GPU, which the moe-cache line names, and their logits are bitwise those of stock's own offload of the
    same batches (GGML_OP_OFFLOAD_MIN_BATCH=8 for the whole process, as before the flag). Without the
    variable, stock computes such a batch on the CPU and the cache's on the GPU: their logits differ
    (within stock's own GPU/CPU envelope), which shows that the flag alone moved the batches."""
    model = fixture_models[name]
    profile = make_profile(gpu_build, model, tmp_path / "p.gguf", 16)
    cmd = [str(gpu_build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile", str(profile),
           "--moe-cache-slots", "3", "--moe-cache-max-batch", "512", "-ngl", "99", "--cpu-moe", "-lm", "none",
           "-ub", "10", "-n", "0", "--moe-cache-offload-min-batch", "8", *DYNAMIC]
    env = {k: v for k, v in os.environ.items() if k != "GGML_OP_OFFLOAD_MIN_BATCH"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env | {"GGML_OP_OFFLOAD_MIN_BATCH": "8"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "layers from 8 tokens" in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert "layers from 8 tokens" in r.stderr, r.stderr[-3000:]
    assert not r.stdout.strip().endswith("logits bitwise equal"), r.stdout


@pytest.mark.parametrize("ubatch", ["100", "7"])
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_misses_read_in_place_equal_stock_full_offload(gpu_build, fixture_models, tmp_path: Path, name: str,
                                                       ubatch: str) -> None:
    """LLAMA_MOE_CACHE_DIRECT=1 (patch 0026): a decoded token's missed experts are computed on the GPU
    too, its kernels reading their rows from pinned RAM in place (-lm none), the resident ones on their slots.
    Every expert then runs the kernel it runs when stock keeps every expert in VRAM, on the same bytes, and each
    (expert, token) is zero in one of the two passes: the design predicts logits bitwise those of stock full
    offload (--ref-full-offload), for prompt batches of 7 (below the plan's 8: the decode path) and of 100
    (the stock pass, the experts copied) and for 32 greedy tokens."""
    model = fixture_models[name]
    profile = make_profile(gpu_build, model, tmp_path / "p.gguf", 16)
    cmd = [str(gpu_build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile", str(profile),
           "--moe-cache-slots", "3", "--moe-cache-max-batch", "512", "-ngl", "99", "--cpu-moe", "-lm", "none",
           "-ub", ubatch, "-n", "32", "--moe-cache-offload-min-batch", "8", *DYNAMIC, "--ref-full-offload"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=os.environ | {"LLAMA_MOE_CACHE_DIRECT": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "layers read their misses in place" in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
