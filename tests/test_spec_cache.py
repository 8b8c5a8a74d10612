"""Speculative decoding with the expert slot cache on the CPU build (slots in RAM with the source's
buffer type, LLAMA_MOE_CACHE_DEVICE=CPU): the MTP head of the hy_v3 synthetic and a separate draft
model propose tokens, the trunk verifies them in batches of several tokens through the slots, and
the greedy tokens equal those of the same server without speculation and of stock llama-server
(no cache flags), with and without speculation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from helpers import fixture_spec, make_profile
from moeplug.server import complete, start_server
from moeplug.serving import parse_cache_line
from moeplug.synth import make_model

pytestmark = pytest.mark.native

# token ids of the synthetic vocabulary: a short prompt, a longer one, a repetitive one (drafts
# of the n-gram kind match there)
PROMPTS = [list(range(40, 52)), [7 * i % 300 + 20 for i in range(70)], [101, 102, 103, 104] * 8]
N_PREDICT = 48


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


def generate(build, model: Path, log: Path, extra: list[str]) -> tuple[list[list[int]], list[dict], str]:
    """Greedy tokens of every prompt from one llama-server run, its timings, and its log."""
    tokens, timings = [], []
    with start_server(build.binary("llama-server"), model, log, extra_args=["-np", "1", *extra], ctx=1024,
                      threads=2, env={"LLAMA_MOE_CACHE_DEVICE": "CPU"}) as srv:
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
def test_speculation_through_the_slots_gives_the_tokens_of_stock(patched_build, spec_models, spec_profile,
                                                                tmp_path: Path, spec: str) -> None:
    """Stock and the cache (3 of 8 experts per layer resident, the MTP block's layer too), each
    without and with speculation (3 draft tokens a step): four runs, the same greedy tokens; the
    speculative runs drafted tokens, and the cache engaged on every MoE layer of the target."""
    speculate = (["--spec-type", "draft-mtp"] if spec == "mtp"
                 else ["-md", str(spec_models[spec]), "--spec-type", "draft-simple"])
    speculate += ["--spec-draft-n-max", "3"]
    runs = {}
    for name, extra in {"stock": [], "stock+spec": speculate, "cache": cache_args(spec_profile, 3),
                        "cache+spec": cache_args(spec_profile, 3) + speculate}.items():
        runs[name] = generate(patched_build, spec_models["target"], tmp_path / f"{name}.log", extra)

    reference = runs["stock"][0]
    assert all(len(t) == N_PREDICT for t in reference)
    for name, (tokens, _, log) in runs.items():
        assert tokens == reference, f"{name}: greedy tokens differ from stock without speculation"
    for name in ("stock+spec", "cache+spec"):
        n_drafted, n_accepted = drafted(runs[name][1])
        assert n_drafted > 0, f"{name}: no token was drafted"
        print(f"{spec} {name}: {n_accepted} of {n_drafted} drafted tokens accepted")
        if spec == "self":
            assert n_accepted > 0.8 * n_drafted
    for name in ("cache", "cache+spec"):
        cache = parse_cache_line(runs[name][2])
        assert cache and cache.engaged and cache.device == "CPU", runs[name][2][-2000:]
        assert cache.layers == 3  # blocks 1 and 2 of the trunk and the MTP block
