"""The patches are opt-in: the patched build run without moeplug's flags computes what the unpatched
build of the same pin computes, bitwise, on every architecture family (the CPU builds, same flags,
same threads). Every change to an upstream file of the series, the graph's MoE pass above all (patch
0004 cuts it into functions the cache calls twice), must keep this.

Compared through llama-server as users run it: the greedy tokens of a completion and, for every
generated token, the probabilities of the most likely ten tokens, printed by each server in full
precision; a long prompt takes the batched path, and one token a batch the decode path."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeplug.serving.server import start_server

pytestmark = pytest.mark.native

PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
          "# the first twenty numbers, one per line, then their sum\n")
N_PREDICT = 24
N_PROBS = 10


def answer(build, model: Path, log: Path) -> dict:
    """One greedy completion of PROMPT with the top N_PROBS probabilities of every generated token."""
    with start_server(build.binary("llama-server"), model, log, ctx=512, threads=2) as srv:
        srv.wait_healthy(timeout=120)
        doc = srv.complete(PROMPT, n_predict=N_PREDICT, ignore_eos=True, n_probs=N_PROBS)
    return {"tokens": doc["tokens"], "probs": doc["completion_probabilities"], "prompt_n": doc["timings"]["prompt_n"]}


@pytest.mark.parametrize("name", ["qwen3moe", "hy_v3", "gpt-oss", "hy_v3-mtp"])
def test_patched_without_flags_is_bitwise_the_unpatched_build(patched_build, stock_build, fixture_models,
                                                             tmp_path: Path, name: str) -> None:
    model = fixture_models[name]
    stock = answer(stock_build, model, tmp_path / "stock.log")
    patched = answer(patched_build, model, tmp_path / "patched.log")
    assert stock["prompt_n"] > 32  # the batched path, not the one llama.cpp keeps on the CPU for short prompts
    # a token whose bytes end inside a UTF-8 character shares its entry with the next (the server's way)
    assert len(stock["tokens"]) == N_PREDICT and N_PREDICT // 2 <= len(stock["probs"]) <= N_PREDICT
    assert all(len(p["top_logprobs"]) == N_PROBS for p in stock["probs"]), stock["probs"][0]
    assert patched["tokens"] == stock["tokens"]
    assert patched["probs"] == stock["probs"]  # every float as the server printed it: the same bits
