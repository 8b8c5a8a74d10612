"""The dynamic slot policy (`--moe-cache-policy dynamic`) and the router's selection counts
(`--moe-cache-record`, `GET /moe-cache/profile`) on the CPU build, slots held in RAM
(LLAMA_MOE_CACHE_DEVICE=CPU): a real llama-server on a real GGUF of the gpt-oss-20b trace's
layout, routed by recorded decisions (route replay) whose hot experts change between prompts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import requests

from moeplug.serving.metrics import CacheCounters, parse_cache_counters
from moeplug.profile import write_profile
from moeplug.profile.format import model_fingerprint, read_profile
from moeplug.profile.from_trace import profile_from_trace
from moeplug.serving.server import start_server
from moeplug.model.synth import ModelSpec, make_model
from moeplug.profile.trace import Trace, write_replay

pytestmark = pytest.mark.native

LAYERS, EXPERTS, USED, SLOTS = 24, 32, 4, 8


def phases_trace(lengths_and_sets: list[tuple[int, int]], seed: int = 5) -> Trace:
    """One prompt per (length, hot set): in each layer 90% of the selections fall on that set's 8
    experts; sets 0 and 1 are disjoint, so slots chosen for one serve the other badly."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(EXPERTS) for _ in range(LAYERS)]
    hot = {k: [perms[layer][k * SLOTS:(k + 1) * SLOTS] for layer in range(LAYERS)] for k in (0, 1)}
    rows = []
    for n, k in lengths_and_sets:
        p = np.full((LAYERS, EXPERTS), 0.1 / (EXPERTS - SLOTS))
        for layer in range(LAYERS):
            p[layer, hot[k][layer]] = 0.9 / SLOTS
        for _ in range(n):
            rows.append([rng.choice(EXPERTS, size=USED, replace=False, p=p[layer]) for layer in range(LAYERS)])
    offsets = np.concatenate([[0], np.cumsum([n for n, _ in lengths_and_sets])]).astype(np.int64)
    return Trace(experts=np.asarray(rows, dtype=np.int32), offsets=offsets, n_expert=EXPERTS,
                 weights=rng.random((len(rows), LAYERS, USED)).astype(np.float32), source="test_dynamic_cache")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(arch="gpt-oss", dtype="q8_0", seed=11, embd=64, expert_ff=64, heads=4, heads_kv=2, head_dim=16,
                     layers=LAYERS, experts=EXPERTS, used=USED)
    return make_model(spec, tmp_path_factory.mktemp("dyn-model") / "gpt-oss-24x32.gguf")[0]


@pytest.fixture(scope="module")
def files(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """replay: prompts [A, B, B] (160, 400, 400 tokens); ab: one prompt of A then B; profiles made
    from the A and the B prompt."""
    d = tmp_path_factory.mktemp("dyn-files")
    trace = phases_trace([(160, 0), (400, 1), (400, 1)])
    out = {"replay": write_replay(trace, d / "aba.replay.gguf")}
    ab = phases_trace([(80, 0), (200, 1)])
    flat = Trace(experts=ab.experts, offsets=np.array([0, len(ab.experts)], dtype=np.int64), n_expert=EXPERTS,
                 weights=ab.weights, source="ab")
    out["ab"] = write_replay(flat, d / "ab.replay.gguf")
    for name, sel in (("profile_a", "0:1"), ("profile_b", "1:2")):
        out[name] = write_profile(profile_from_trace(trace.select(sel), model), d / f"{name}.gguf")
    return out


def counters(url: str) -> CacheCounters:
    c = parse_cache_counters(requests.get(f"{url}/metrics", timeout=10).text)
    assert c is not None
    return c


def hit_rate(before: CacheCounters, after: CacheCounters) -> float:
    return (after.hits - before.hits) / (after.selections - before.selections)


def serve_three(binary: Path, model: Path, replay: Path, log: Path, cache_args: list[str]) -> dict:
    """Requests 1-3 replay prompts A, B, B (the whole prompt: 30 prompt tokens + the rest generated);
    the hit rate of each request and the greedy tokens and probabilities of all."""
    args = ["--metrics", "--moe-route-replay", str(replay), "--moe-cache-max-batch", "512", *cache_args]
    res: dict = {"rates": [], "outputs": [], "swaps": 0}
    with start_server(binary, model, log, extra_args=args, ctx=1024, threads=2,
                      env={"LLAMA_MOE_CACHE_DEVICE": "CPU"}) as srv:
        srv.wait_healthy(timeout=180)
        for n_rows in (160, 400, 400):
            before = counters(srv.url) if cache_args else None
            reply = srv.complete(list(range(100, 130)), n_predict=n_rows - 30 + 1, ignore_eos=True, n_probs=1)
            res["outputs"].append((reply["tokens"], reply["completion_probabilities"]))
            if cache_args:
                after = counters(srv.url)
                # one device holds every layer's slots: its counters are the totals
                assert after.devices == {"CPU": {"selections": after.selections, "hits": after.hits}}
                res["rates"].append(hit_rate(before, after))
                res["swaps"] = after.swaps
    return res


def test_dynamic_slots_follow_the_prompt_exactly(patched_build, model, files, tmp_path: Path) -> None:
    """Slots from prompt A's profile, then prompt B (other hot experts) twice. Static slots keep
    missing B's experts; dynamic ones swap them in (swaps counted on /metrics) and serve B within 10
    points of slots made from B's own profile, and every token and probability stays the
    no-cache run's, bit for bit."""
    binary = patched_build.binary("llama-server")
    slots = ["--moe-cache-slots", str(SLOTS)]
    stock = serve_three(binary, model, files["replay"], tmp_path / "stock.log", [])
    static = serve_three(binary, model, files["replay"], tmp_path / "static.log",
                         ["--moe-cache-profile", str(files["profile_a"]), *slots])
    dynamic = serve_three(binary, model, files["replay"], tmp_path / "dynamic.log",
                          ["--moe-cache-profile", str(files["profile_a"]), *slots, "--moe-cache-policy", "dynamic"])
    own = serve_three(binary, model, files["replay"], tmp_path / "own.log",
                      ["--moe-cache-profile", str(files["profile_b"]), *slots])
    log = (tmp_path / "dynamic.log").read_text()
    assert "policy dynamic (half-life 128 tokens, 4 uploads per batch)" in log, log[-2000:]
    assert "policy static" in (tmp_path / "static.log").read_text()
    print(f"hit rates A, B, B: static {static['rates']}, dynamic {dynamic['rates']} ({dynamic['swaps']} swaps), "
          f"B's own profile {own['rates']}")

    assert dynamic["swaps"] > 0 and static["swaps"] == 0
    assert dynamic["rates"][1] > static["rates"][1] + 0.2
    assert dynamic["rates"][2] > static["rates"][2] + 0.3
    assert dynamic["rates"][2] >= own["rates"][2] - 0.10
    for run in (static, dynamic, own):
        assert run["outputs"] == stock["outputs"]


@pytest.mark.parametrize("stream", ["0", "0.4"])
def test_dynamic_policy_is_bitwise_stock_mid_batch(patched_build, model, files, stream: str) -> None:
    """test-moe-cache on one sequence whose hot experts change at token 80 (inside the prompt): 100
    prompt tokens in ubatches of 7 and 64, 64 greedy tokens, logits bitwise equal with and without
    the dynamic cache; with --moe-cache-stream the streamed set follows the swaps too."""
    env = {**os.environ, "LLAMA_MOE_CACHE_DEVICE": "CPU"}
    for ubatch in (7, 64):
        r = subprocess.run([str(patched_build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile",
                            str(files["profile_a"]), "--moe-cache-slots", str(SLOTS), "--moe-cache-max-batch", "512",
                            "--moe-cache-policy", "dynamic", "--moe-cache-half-life", "16", "--moe-cache-stream", stream,
                            "--moe-route-replay", str(files["ab"]), "-ub", str(ubatch), "-n", "64", "-t", "2"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
        assert "policy dynamic (half-life 16 tokens" in r.stderr


def test_parallel_sequences_with_swaps_match_stock(patched_build, model, tmp_path: Path) -> None:
    """Four sequences at once (-np 4, one request of four prompts) on the router's own choices, slots
    from a profile of other routing so that they swap: no error, and every output equal to the
    no-cache server's under the same load."""
    binary = patched_build.binary("llama-server")
    profile = write_profile(profile_from_trace(phases_trace([(200, 1)], seed=9), model), tmp_path / "p.gguf")
    prompts = [list(range(100 + 37 * i, 140 + 37 * i)) for i in range(4)]
    outs = []
    for name, extra in (("stock", []), ("dynamic", ["--moe-cache-profile", str(profile), "--moe-cache-slots",
                                                     str(SLOTS), "--moe-cache-policy", "dynamic",
                                                     "--moe-cache-half-life", "8"])):
        with start_server(binary, model, tmp_path / f"{name}.log", ctx=2048, threads=2,
                          extra_args=["-np", "4", "--metrics", "--moe-cache-max-batch", "512", *extra],
                          env={"LLAMA_MOE_CACHE_DEVICE": "CPU"}) as srv:
            srv.wait_healthy(timeout=180)
            r = requests.post(f"{srv.url}/completion", timeout=300, json={
                "prompt": prompts, "n_predict": 96, "temperature": 0.0, "cache_prompt": False, "ignore_eos": True,
                "return_tokens": True, "n_probs": 1})
            assert r.status_code == 200, r.text[:500]
            replies = r.json()
            assert len(replies) == 4
            outs.append([(x["tokens"], x["completion_probabilities"]) for x in replies])
            if extra:
                c = counters(srv.url)
                assert c.swaps > 0, "the slots never changed: the test would not test swaps"
    assert outs[0] == outs[1]


def test_recorded_selections_are_a_profile(patched_build, model, files, tmp_path: Path) -> None:
    """--moe-cache-record with the cache on: after two different prompt sets, /moe-cache/profile is
    a valid profile of this model whose per-layer counts equal the selections /metrics counted
    (every batch ran the slots), prompt and generated tokens apart; ?reset=1 zeroes them; a server
    without the flag answers 404. Without a cache the counts still add up to the tokens."""
    binary = patched_build.binary("llama-server")
    args = ["--metrics", "--moe-cache-record", "--moe-cache-max-batch", "512", "--moe-cache-profile",
            str(files["profile_a"]), "--moe-cache-slots", str(SLOTS)]
    with start_server(binary, model, tmp_path / "rec.log", extra_args=args, ctx=1024, threads=2,
                      env={"LLAMA_MOE_CACHE_DEVICE": "CPU"}) as srv:
        srv.wait_healthy(timeout=180)
        srv.complete(list(range(100, 140)), n_predict=24, ignore_eos=True)
        srv.complete("def f(x):\n    return x * 2\n" * 3, n_predict=16, ignore_eos=True)
        c = counters(srv.url)
        r = requests.get(f"{srv.url}/moe-cache/profile", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/octet-stream")
        (tmp_path / "live.gguf").write_bytes(r.content)
        assert requests.get(f"{srv.url}/moe-cache/profile?reset=1", timeout=10).status_code == 200
        zero = requests.get(f"{srv.url}/moe-cache/profile", timeout=10).content
        (tmp_path / "zero.gguf").write_bytes(zero)
    assert "moe-cache: recording the router's selections of 24 layers" in (tmp_path / "rec.log").read_text()

    live = read_profile(tmp_path / "live.gguf")
    assert live.fingerprint == model_fingerprint(model)
    assert [s.label for s in live.sources] == ["live"]
    per_layer = live.counts_prefill.sum(axis=1) + live.counts_decode.sum(axis=1)
    blocks = sorted(c.layers)
    assert per_layer.tolist() == [c.layers[b]["selections"] for b in blocks]
    assert live.counts_decode.sum() > 0 and live.counts_prefill.sum() > 0
    assert (live.counts_prefill.sum(axis=1) == live.tokens(0) * USED).all()
    assert (live.counts_decode.sum(axis=1) == live.tokens(1) * USED).all()
    zeroed = read_profile(tmp_path / "zero.gguf")
    assert zeroed.counts_prefill.sum() + zeroed.counts_decode.sum() == 0

    with start_server(binary, model, tmp_path / "plain.log", ctx=512, threads=2) as srv:
        srv.wait_healthy(timeout=180)
        assert requests.get(f"{srv.url}/moe-cache/profile", timeout=10).status_code == 404
    with start_server(binary, model, tmp_path / "nocache.log", extra_args=["--moe-cache-record"], ctx=512,
                      threads=2) as srv:
        srv.wait_healthy(timeout=180)
        srv.complete(list(range(100, 120)), n_predict=10, ignore_eos=True)
        (tmp_path / "nocache.gguf").write_bytes(requests.get(f"{srv.url}/moe-cache/profile", timeout=10).content)
    alone = read_profile(tmp_path / "nocache.gguf")
    assert alone.tokens(0) + alone.tokens(1) >= 20 + 9
    assert ((alone.counts_prefill + alone.counts_decode).sum(axis=1) == (alone.tokens(0) + alone.tokens(1)) * USED).all()
