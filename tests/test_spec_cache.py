"""Speculative decoding with the expert slot cache on the CPU build (slots in RAM with the source's
buffer type, LLAMA_MOE_CACHE_DEVICE=CPU): the MTP head of the hy_v3 synthetic and a separate draft
model propose tokens, the trunk verifies them in batches of several tokens through the slots, and
the greedy tokens equal those of the same server without speculation and of stock llama-server
(no cache flags), with and without speculation.

On a GPU (MOEPLUG_GPU_BIN=<bin/ of a patched CUDA build>; skipped in CI) the same runs with every
layer on the GPU but the experts in RAM (`-ngl 99 --cpu-moe`), the cache's slots in VRAM: the cache's
tokens with speculation must equal its tokens without (llama.cpp's promise for greedy decoding, the
GPU computing the hits), and stock's likewise. Across the two placements the GPU's kernels and the
CPU's round differently, so there the tokens are compared within each placement only."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import Prebuilt, fixture_spec, make_profile
from moeplug.server import complete, start_server
from moeplug.serving import parse_cache_line
from moeplug.synth import make_model

pytestmark = pytest.mark.native

# token ids of the synthetic vocabulary: a short prompt, a longer one, a repetitive one (drafts
# of the n-gram kind match there)
PROMPTS = [list(range(40, 52)), [7 * i % 300 + 20 for i in range(70)], [101, 102, 103, 104] * 8]
N_PREDICT = 48
GPU_BIN = os.environ.get("MOEPLUG_GPU_BIN")


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "gpu" and not GPU_BIN:
        pytest.skip("needs MOEPLUG_GPU_BIN, the bin/ of a patched CUDA build")
    return request.param


@pytest.fixture(scope="module")
def spec_build(device: str, request: pytest.FixtureRequest):
    """The patched CPU build (built here), or the CUDA build MOEPLUG_GPU_BIN names."""
    return request.getfixturevalue("patched_build") if device == "cpu" else Prebuilt(Path(GPU_BIN or "."))


@pytest.fixture(scope="module")
def spec_models(fixture_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The hy_v3 synthetic with an MTP block; a draft model of the same vocabulary (hy_v3 with two
    blocks and other weights: random weights agree on few tokens); and the target's own trunk as a
    draft (the same weights without the MTP block: it proposes what the target picks, so nearly
    every drafted token is accepted and most tokens come out of verification batches)."""
    root = tmp_path_factory.mktemp("spec-models")
    draft = make_model(replace(fixture_spec("hy_v3", seed=11), layers=2), root / "hy_v3-draft.gguf")[0]
    return {"target": fixture_models["hy_v3-mtp"], "draft": draft, "self": fixture_models["hy_v3"]}


@pytest.fixture(scope="module")
def spec_profile(spec_build, spec_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real profile of the target, its MTP block included."""
    return make_profile(spec_build, spec_models["target"],
                        tmp_path_factory.mktemp("spec-profile") / "target.profile.gguf", 16)


def generate(build, model: Path, log: Path, extra: list[str], device: str = "cpu"
             ) -> tuple[list[list[int]], list[dict], str]:
    """Greedy tokens of every prompt from one llama-server run, its timings, and its log (on the GPU:
    every layer there, the experts in RAM, a draft model's layers on the GPU)."""
    tokens, timings = [], []
    place = ["-ngl", "99", "--cpu-moe"] + (["-ngld", "99"] if "-md" in extra else []) if device == "gpu" else []
    env = {"LLAMA_MOE_CACHE_DEVICE": "CPU"} if device == "cpu" else {}
    with start_server(build.binary("llama-server"), model, log, extra_args=["-np", "1", *place, *extra], ctx=1024,
                      threads=2, env=env) as srv:
        srv.wait_healthy()
        for prompt in PROMPTS:
            reply = complete(srv.url, prompt, n_predict=N_PREDICT, ignore_eos=True)
            tokens.append(reply["tokens"])
            timings.append(reply["timings"])
    return tokens, timings, log.read_text(errors="replace")


def cache_args(profile: Path, slots: int) -> list[str]:
    return ["--moe-cache-profile", str(profile), "--moe-cache-slots", str(slots)]


def drafted(timings: list[dict]) -> tuple[int, int]:
    return sum(t.get("draft_n", 0) for t in timings), sum(t.get("draft_n_accepted", 0) for t in timings)


@pytest.mark.parametrize("spec", ["mtp", "draft", "self"])
def test_speculation_through_the_slots_gives_the_tokens_of_stock(spec_build, device, spec_models, spec_profile,
                                                                tmp_path: Path, spec: str) -> None:
    """Stock and the cache (3 of 8 experts per layer resident, the MTP block's layer too), each
    without and with speculation (3 draft tokens a step): four runs, the same greedy tokens (on the
    GPU: with and without speculation, within each placement); the speculative runs drafted tokens,
    and the cache engaged on every MoE layer of the target."""
    speculate = (["--spec-type", "draft-mtp"] if spec == "mtp"
                 else ["-md", str(spec_models[spec]), "--spec-type", "draft-simple"])
    speculate += ["--spec-draft-n-max", "3"]
    runs = {}
    for name, extra in {"stock": [], "stock+spec": speculate, "cache": cache_args(spec_profile, 3),
                        "cache+spec": cache_args(spec_profile, 3) + speculate}.items():
        runs[name] = generate(spec_build, spec_models["target"], tmp_path / f"{name}.log", extra, device)

    assert all(len(t) == N_PREDICT for t in runs["stock"][0])
    for name, (tokens, _, log) in runs.items():
        reference = "cache" if device == "gpu" and name.startswith("cache") else "stock"
        assert tokens == runs[reference][0], f"{name}: greedy tokens differ from {reference} without speculation"
    for name in ("stock+spec", "cache+spec"):
        n_drafted, n_accepted = drafted(runs[name][1])
        assert n_drafted > 0, f"{name}: no token was drafted"
        print(f"{device} {spec} {name}: {n_accepted} of {n_drafted} drafted tokens accepted")
        if spec == "self":
            assert n_accepted > 0.8 * n_drafted
    for name in ("cache", "cache+spec"):
        cache = parse_cache_line(runs[name][2])
        where = "CPU" if device == "cpu" else "CUDA0"
        assert cache and cache.engaged and cache.device == where, runs[name][2][-2000:]
        assert cache.layers == 3  # blocks 1 and 2 of the trunk and the MTP block
