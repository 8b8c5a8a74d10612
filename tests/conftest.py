"""Shared fixtures: synthetic models of every family, and real llama.cpp builds.

The native builds go to the user's moeplug cache and data dirs (XDG), exactly where
`moeplug native build` puts them, so a second test run reuses them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moeplug.synth import ARCHS, ModelSpec, make_model

# Small but real: 256-wide rows so every dtype, Q4_K included, applies to the expert tensors.
FIXTURE_SHAPE = dict(layers=3, experts=8, used=2, embd=256, expert_ff=256, heads=4, heads_kv=2, head_dim=64)


def fixture_spec(arch: str, dtype: str = "q8_0", seed: int = 7) -> ModelSpec:
    return ModelSpec(arch=arch, dtype=dtype, seed=seed, **FIXTURE_SHAPE)


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One Q8_0 model per architecture family, and hy_v3 with an MTP (NextN) block."""
    from dataclasses import replace

    root = tmp_path_factory.mktemp("models")
    models = {arch: make_model(fixture_spec(arch), root / f"{arch}.gguf")[0] for arch in ARCHS}
    models["hy_v3-mtp"] = make_model(replace(fixture_spec("hy_v3"), mtp_layers=1), root / "hy_v3-mtp.gguf")[0]
    return models


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `moeplug` command in a child process."""
    return subprocess.run([sys.executable, "-m", "moeplug", *args], capture_output=True, text=True)


@pytest.fixture(scope="session")
def patched_build():
    from moeplug.native import build, resolve_options

    return build(resolve_options("cpu", stock=False, jobs=0, cuda_arch=None))


@pytest.fixture(scope="session")
def stock_build():
    from moeplug.native import build, resolve_options

    return build(resolve_options("cpu", stock=True, jobs=0, cuda_arch=None))


def write_npz(path: Path, prompts: int = 12, seed: int = 3, layers: int = 24, experts: int = 32,
              used: int = 4, **override):
    """A routing trace in the npz layout of shared/data/traces (default: gpt-oss-20b's 24 layers x 4
    of 32): skewed, random, every expert id present, each token's ids distinct."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 40, size=prompts)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    skew = rng.dirichlet(np.full(experts, 0.5), size=layers)
    ex = np.stack([np.stack([rng.choice(experts, used, replace=False, p=skew[layer]) for layer in range(layers)])
                   for _ in range(n)]).astype(np.uint8)
    k = min(n, experts)  # layer 0 of the first tokens selects every expert id
    ex[:k, 0] = (np.arange(k)[:, None] + np.arange(used)) % experts
    probs = rng.random(ex.shape).astype(np.float16)
    arrays = {"experts": ex, "probs": probs, "offsets": offsets, **override}
    np.savez_compressed(path, **arrays)
    return arrays
