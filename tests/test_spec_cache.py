"""Speculative decoding with the expert slot cache on the CPU build (slots in RAM with the source's
buffer type, LLAMA_MOE_CACHE_DEVICE=CPU): the MTP head of the hy_v3 synthetic and a separate draft
model propose tokens, the trunk verifies them in batches of several tokens through the slots, and
the greedy tokens equal those of the same server without speculation and of stock llama-server
(no cache flags), with and without speculation.

On a GPU (MOEPLUG_GPU_BIN=<bin/ of a patched CUDA build>; skipped in CI) every layer runs there, the
experts in RAM (`-ngl 99 --cpu-moe`). llama.cpp's promise for greedy decoding (speculation does not
change the tokens) does not hold there for stock itself: a verification batch's CUDA kernels round
otherwise than a single token's, and on these random-weight models a near tie flips (the H200 showed
it, `native/bench/results/2026-12-02-server-rounds-vram/`). So the GPU test asserts what does hold: the cache with
its slots in RAM computes the experts as stock's CPU does, so its tokens equal stock's with and
without speculation; with the slots in VRAM it engages there and verifies drafts, and the test
prints where its tokens and stock's part from their runs without speculation."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import Prebuilt, fixture_spec, make_profile
from moeplug.serving.client import complete
from moeplug.serving.server import start_server
from moeplug.serving.launch import parse_cache_line
from moeplug.model.synth import make_model

pytestmark = pytest.mark.native

# token ids of the synthetic vocabulary: a short prompt, a longer one, a repetitive one (drafts
# of the n-gram kind match there)
PROMPTS = [list(range(40, 52)), [7 * i % 300 + 20 for i in range(70)], [101, 102, 103, 104] * 8]
N_PREDICT = 48
GPU_BIN = os.environ.get("MOEPLUG_GPU_BIN")


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
def spec_profile(patched_build, spec_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real profile of the target, its MTP block included."""
    return make_profile(patched_build, spec_models["target"],
                        tmp_path_factory.mktemp("spec-profile") / "target.profile.gguf", 16)


def generate(build, model: Path, log: Path, extra: list[str], env: dict[str, str] | None = None
             ) -> tuple[list[list[int]], list[dict], str]:
    """Greedy tokens of every prompt from one llama-server run, its timings, and its log (the cache's
    slots on the CPU unless env says otherwise)."""
    tokens, timings = [], []
    with start_server(build.binary("llama-server"), model, log, extra_args=["-np", "1", *extra], ctx=1024,
                      threads=2, env={"LLAMA_MOE_CACHE_DEVICE": "CPU"} if env is None else env) as srv:
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


def speculation_args(spec: str, spec_models: dict[str, Path]) -> list[str]:
    """3 draft tokens a step from the MTP head or a draft model."""
    speculate = (["--spec-type", "draft-mtp"] if spec == "mtp"
                 else ["-md", str(spec_models[spec]), "--spec-type", "draft-simple"])
    return speculate + ["--spec-draft-n-max", "3"]


def parted_at(tokens: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where tokens and reference differ (None: equal)."""
    return [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), None) for t, r in zip(tokens, reference)]


@pytest.mark.parametrize("spec", ["mtp", "draft", "self"])
def test_speculation_through_the_slots_gives_the_tokens_of_stock(patched_build, spec_models, spec_profile,
                                                                tmp_path: Path, spec: str) -> None:
    """Stock and the cache (3 of 8 experts per layer resident, the MTP block's layer too), each
    without and with speculation (3 draft tokens a step), and the cache with speculation and three
    quarters of each layer's misses in the streamed pass, the share moeplug plans where streaming is
    modelled to pay (--moe-cache-stream 0.75):
    five runs, the same greedy tokens; the speculative runs drafted tokens, and the cache engaged on
    every MoE layer of the target."""
    speculate = speculation_args(spec, spec_models)
    stream = ["--moe-cache-stream", "0.75"]
    runs = {}
    for name, extra in {"stock": [], "stock+spec": speculate, "cache": cache_args(spec_profile, 3),
                        "cache+spec": cache_args(spec_profile, 3) + speculate,
                        "cache+stream+spec": cache_args(spec_profile, 3) + stream + speculate}.items():
        runs[name] = generate(patched_build, spec_models["target"], tmp_path / f"{name}.log", extra)

    reference = runs["stock"][0]
    assert all(len(t) == N_PREDICT for t in reference)
    for name, (tokens, _, log) in runs.items():
        assert tokens == reference, f"{name}: greedy tokens differ from stock without speculation"
    for name in ("stock+spec", "cache+spec", "cache+stream+spec"):
        n_drafted, n_accepted = drafted(runs[name][1])
        assert n_drafted > 0, f"{name}: no token was drafted"
        print(f"{spec} {name}: {n_accepted} of {n_drafted} drafted tokens accepted")
        if spec == "self":
            assert n_accepted > 0.8 * n_drafted
    for name in ("cache", "cache+spec", "cache+stream+spec"):
        cache = parse_cache_line(runs[name][2])
        assert cache and cache.engaged and cache.device == "CPU", runs[name][2][-2000:]
        assert cache.layers == 3  # blocks 1 and 2 of the trunk and the MTP block
        assert (cache.streamed_layers, cache.stream_percent) == ((3, 75) if "stream" in name else (0, 0)), \
            runs[name][2][-2000:]


@pytest.mark.skipif(not GPU_BIN, reason="needs MOEPLUG_GPU_BIN, the bin/ of a patched CUDA build")
@pytest.mark.parametrize("spec", ["mtp", "draft", "self"])
def test_speculation_on_a_gpu_build(spec_models, tmp_path: Path, spec: str) -> None:
    """The GPU build, every layer on the GPU and the experts in RAM: stock, the cache with its slots
    in RAM and with them in VRAM, each without and with speculation. In RAM the cache's tokens are
    stock's, with and without speculation; in VRAM it engages on the GPU and its drafts are verified."""
    gpu = Prebuilt(Path(GPU_BIN or "."))
    profile = make_profile(gpu, spec_models["target"], tmp_path / "target.profile.gguf", 16)
    place = ["-ngl", "99", "--cpu-moe"] + (["-ngld", "99"] if spec != "mtp" else [])
    speculate = speculation_args(spec, spec_models)
    in_ram, in_vram = {"LLAMA_MOE_CACHE_DEVICE": "CPU"}, {}
    runs = {name: generate(gpu, spec_models["target"], tmp_path / f"{name}.log", place + extra, env)
            for name, extra, env in [("stock", [], in_vram), ("stock+spec", speculate, in_vram),
                                     ("ram", cache_args(profile, 3), in_ram),
                                     ("ram+spec", cache_args(profile, 3) + speculate, in_ram),
                                     ("vram", cache_args(profile, 3), in_vram),
                                     ("vram+spec", cache_args(profile, 3) + speculate, in_vram)]}
    for name in ("stock+spec", "vram+spec"):
        base = name.removesuffix("+spec")
        print(f"gpu {spec} {name}: drafted/accepted {drafted(runs[name][1])}, parts from {base} at "
              f"{parted_at(runs[name][0], runs[base][0])} of {N_PREDICT}")
    assert runs["ram"][0] == runs["stock"][0], "slots in RAM: greedy tokens differ from stock's"
    assert runs["ram+spec"][0] == runs["stock+spec"][0], "slots in RAM, speculating: tokens differ from stock's"
    for name, where in (("ram", "CPU"), ("ram+spec", "CPU"), ("vram", "CUDA0"), ("vram+spec", "CUDA0")):
        cache = parse_cache_line(runs[name][2])
        assert cache and cache.engaged and cache.device == where and cache.layers == 3, runs[name][2][-2000:]
    for name in ("stock+spec", "ram+spec", "vram+spec"):
        assert drafted(runs[name][1])[0] > 0, f"{name}: no token was drafted"
    assert all(len(t) == N_PREDICT for t in runs["vram+spec"][0])
