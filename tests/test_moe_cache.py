"""The expert slot cache on the CPU build: bitwise equal to stock, and a clean fallback when it
cannot engage. Slots live on the CPU with the source's buffer type (LLAMA_MOE_CACHE_DEVICE=CPU),
so the same kernels compute every expert, repacked ones included."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import FIXTURE_SHAPE, fixture_spec, make_profile
from moeplug.serving.metrics import CacheCounters, parse_cache_counters
from moeplug.serving.server import start_server
from moeplug.serving.launch import parse_cache_line
from moeplug.model.synth import make_model

pytestmark = pytest.mark.native

NOT_ENGAGED = "moe-cache: not engaged, running without it: "
N_EXPERT = 8  # helpers.FIXTURE_SHAPE


@pytest.fixture(scope="session")
def cache_models(fixture_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family (q8_0: repacked on x86), plus plain f16 and repacked q4_K with per-expert scales."""
    root = tmp_path_factory.mktemp("cache-models")
    models = dict(fixture_models)
    for dtype in ("f16", "q4_k"):
        spec = replace(fixture_spec("qwen3moe", dtype=dtype), expert_scales=True)
        models[f"qwen3moe-{dtype}-scales"] = make_model(spec, root / f"qwen3moe-{dtype}.gguf")[0]
    return models


@pytest.fixture(scope="session")
def profiles(patched_build, cache_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real profile of each model, from llama-moe-profile on the bundled code prompts."""
    root = tmp_path_factory.mktemp("cache-profiles")
    return {name: make_profile(patched_build, model, root / f"{name}.profile.gguf", 16)
            for name, model in cache_models.items()}


@pytest.fixture
def slots_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_MOE_CACHE_DEVICE", "CPU")


def run_cache_test(build, model: Path, profile: Path, slots: int | str, ubatch: int, env: dict[str, str] | None = None,
                   n_predict: int = 128, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [str(build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile", str(profile),
           "--moe-cache-slots", str(slots), "-ub", str(ubatch), "-n", str(n_predict), "-t", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def assert_bitwise(r: subprocess.CompletedProcess[str], slots: int | str) -> None:
    """slots: the count of every layer, or one per layer ("8,0,3")"""
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
    cache = parse_cache_line(r.stderr)
    counts = [n for n in map(int, str(slots).split(",")) if n > 0]
    assert cache and cache.engaged and cache.device == "CPU", r.stderr[-2000:]
    assert (cache.slots_min, cache.slots) == (min(counts), max(counts))
    if "," not in str(slots):
        counts = counts * cache.layers
    assert cache.layers == len(counts)
    if "," in str(slots) or max(counts) == N_EXPERT:
        assert cache.slots_total == sum(counts) and cache.whole_layers == counts.count(N_EXPERT)


MODELS = ["qwen3moe", "hy_v3", "gpt-oss", "hy_v3-mtp", "qwen3moe-f16-scales", "qwen3moe-q4_k-scales"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("slots", [1, 3, N_EXPERT])
def test_slots_on_cpu_are_bitwise_stock(patched_build, cache_models, profiles, slots_on_cpu, name: str, slots: int) -> None:
    """100 prompt tokens in ubatches of 7 (the two-pass graph) and 128 greedy tokens, one per
    batch: every logit equal to the model without the cache, bitwise."""
    assert_bitwise(run_cache_test(patched_build, cache_models[name], profiles[name], slots, ubatch=7), slots)


@pytest.mark.parametrize("name", MODELS)
def test_cache_without_resident_experts_is_bitwise_stock(patched_build, cache_models, profiles, slots_on_cpu,
                                                         name: str) -> None:
    """The whole two-pass graph with maps that keep every expert on the source weights."""
    r = run_cache_test(patched_build, cache_models[name], profiles[name], 3, ubatch=7,
                       env={"LLAMA_MOE_CACHE_NO_RESIDENT": "1"})
    assert_bitwise(r, 3)


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss", "qwen3moe-q4_k-scales"])
@pytest.mark.parametrize("share", ["0.5", "1"])
def test_streamed_misses_are_bitwise_stock(patched_build, cache_models, profiles, slots_on_cpu, name: str,
                                           share: str) -> None:
    """--moe-cache-stream: a third pass computes the hottest misses (with the slots on the CPU it runs
    there too, on the source weights and full copies of the biases and scales); every logit stays
    stock's, bitwise, and the log names the layers that stream."""
    r = run_cache_test(patched_build, cache_models[name], profiles[name], 3, ubatch=7,
                       extra=("--moe-cache-stream", share))
    assert_bitwise(r, 3)
    cache = parse_cache_line(r.stderr)
    assert cache and (cache.streamed_layers, cache.stream_percent) == (cache.layers, round(100 * float(share))), \
        r.stderr[-2000:]


def per_layer(pattern: str, n_layers: int) -> str:
    """'whole first': a whole layer, layers left out, a partial one; 'partial first': then whole ones"""
    counts = [N_EXPERT] + [0] * (n_layers - 2) + [3] if pattern == "whole first" else [1] + [N_EXPERT] * (n_layers - 1)
    return ",".join(map(str, counts))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("pattern", ["whole first", "partial first"])
def test_slots_per_layer_are_bitwise_stock(patched_build, cache_models, profiles, slots_on_cpu, name: str,
                                           pattern: str) -> None:
    """One count per layer: a whole layer (every expert resident, no host pass), layers left out,
    partial layers; ubatch 7 and 64 (whole layers take the slots above the max batch too)."""
    from moeplug.profile.format import read_profile

    slots = per_layer(pattern, len(read_profile(profiles[name]).tensors))
    for ubatch in (7, 64):
        assert_bitwise(run_cache_test(patched_build, cache_models[name], profiles[name], slots, ubatch=ubatch), slots)


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_batches_above_max_batch_are_bitwise_stock(patched_build, cache_models, profiles, slots_on_cpu, name: str) -> None:
    """Prefill ubatches of 64 tokens (above the default max batch of 31) take the stock graph;
    decode (1 token) takes the cache."""
    assert_bitwise(run_cache_test(patched_build, cache_models[name], profiles[name], 3, ubatch=64), 3)


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_large_batches_through_the_cache_are_bitwise_stock(patched_build, cache_models, profiles, slots_on_cpu,
                                                          name: str) -> None:
    """--moe-cache-max-batch 64: prefill ubatches of 64 tokens take the two-pass graph too."""
    r = run_cache_test(patched_build, cache_models[name], profiles[name], 3, ubatch=64,
                       extra=("--moe-cache-max-batch", "64"))
    assert_bitwise(r, 3)


def test_fidelity_harness_runs_on_cpu(patched_build, cache_models, profiles, slots_on_cpu) -> None:
    """test-moe-cache --fidelity: the harness the GPU fidelity check uses (agreement and KL of the
    cache and of stock full offload against --cpu-moe). On a CPU build every placement computes
    with the same kernels: 100% agreement and zero KL for both."""
    r = subprocess.run([str(patched_build.binary("test-moe-cache")), "-m", str(cache_models["qwen3moe"]),
                        "--moe-cache-profile", str(profiles["qwen3moe"]), "--moe-cache-slots", "3", "--cpu-moe",
                        "--fidelity", "3", "-n", "16", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert "fidelity over 3 prompts x 16 greedy tokens" in lines[0]
    for line in lines[1:3]:
        assert "top-token agreement 100.0000%  mean KL 0.000e+00" in line, line
    assert "only full offload agrees on 0 steps, only the cache on 0 (z = +0.00)" in lines[3]
    assert lines[4].endswith("fidelity PASS: the cache is within stock's own envelope")


def graph_of(build, model: Path, profile: Path, slots: str) -> str:
    r = subprocess.run([str(build.binary("llama-eval-callback")), "-m", str(model), "--moe-cache-profile", str(profile),
                        "--moe-cache-slots", slots, "-p", "hello world", "-n", "1", "-t", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    return r.stdout + r.stderr


def test_two_pass_graph_is_built(patched_build, cache_models, profiles, slots_on_cpu) -> None:
    """The bitwise tests are not vacuous: with the cache on, the graph holds both passes and the
    merge; a whole layer runs on its slots alone, with no host pass."""
    out = graph_of(patched_build, cache_models["qwen3moe"], profiles["qwen3moe"], "3")
    for name in ("ffn_moe_ids_src-0", "ffn_moe_ids_slot-0", "ffn_moe_experts_merged-0"):
        assert name in out, name
    assert "blk.0.ffn_down_exps.weight.slots" in out

    out = graph_of(patched_build, cache_models["qwen3moe"], profiles["qwen3moe"], f"{N_EXPERT},3,0")
    assert "blk.0.ffn_down_exps.weight.slots" in out and "ffn_moe_ids_src-0" not in out
    assert "ffn_moe_experts_merged-1" in out and "blk.2.ffn_down_exps.weight.slots" not in out
    assert "ffn_moe_ids_str" not in out


def test_streamed_pass_is_built(patched_build, cache_models, profiles, slots_on_cpu,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """LLAMA_MOE_CACHE_STREAM (the experiments' override of --moe-cache-stream) adds the third pass
    and its sum to each partly resident layer, and gpt-oss's expert biases get full copies."""
    monkeypatch.setenv("LLAMA_MOE_CACHE_STREAM", "0.5")
    out = graph_of(patched_build, cache_models["gpt-oss"], profiles["gpt-oss"], "3")
    for name in ("ffn_moe_ids_str-0", "ffn_moe_experts_str-0", "ffn_moe_experts_dev-0", "ffn_moe_experts_merged-0",
                 "blk.0.ffn_up_exps.bias.mirror"):
        assert name in out, name
    monkeypatch.setenv("LLAMA_MOE_CACHE_STREAM", "2")
    r = subprocess.run([str(patched_build.binary("llama-eval-callback")), "-m", str(cache_models["gpt-oss"]),
                        "--moe-cache-profile", str(profiles["gpt-oss"]), "--moe-cache-slots", "3", "-p", "hi",
                        "-n", "1", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert NOT_ENGAGED + "LLAMA_MOE_CACHE_STREAM=2: give the share" in r.stderr, r.stderr[-2000:]


def test_every_moe_architecture_mock_is_bitwise(patched_build) -> None:
    """llama.cpp's own mock model of every MoE architecture, cache on (half and all experts
    resident) vs off, logits bitwise (test-llama-archs --moe-cache, our extension)."""
    r = subprocess.run([str(patched_build.binary("test-llama-archs")), "--moe-cache", "-s", "42"],
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"Summary: (\d+) moe-cache test\(s\) executed, (\d+) failed", out)
    assert m and int(m[2]) == 0 and int(m[1]) >= 100, out[-3000:]
    assert "| FAIL" not in out


def serve_once(build, model: Path, tmp_path: Path, name: str, extra: list[str]) -> tuple[list[int], str]:
    """Greedy tokens of one completion and the server's log."""
    log = tmp_path / f"{name}.log"
    with start_server(build.binary("llama-server"), model, log, extra_args=extra, ctx=512, threads=2) as srv:
        srv.wait_healthy(timeout=120)
        tokens = srv.complete("def fibonacci(n):", n_predict=32, ignore_eos=True)["tokens"]
    return tokens, log.read_text(errors="replace")


def test_server_engages_and_matches_stock(patched_build, cache_models, profiles, slots_on_cpu, tmp_path: Path) -> None:
    model, profile = cache_models["gpt-oss"], profiles["gpt-oss"]
    stock_tokens, stock_log = serve_once(patched_build, model, tmp_path, "stock", [])
    assert "moe-cache:" not in stock_log
    tokens, log = serve_once(patched_build, model, tmp_path, "cached",
                             ["--moe-cache-profile", str(profile), "--moe-cache-slots", "5"])
    engaged = [line for line in log.splitlines() if "moe-cache:" in line]
    cache = parse_cache_line(engaged[0]) if len(engaged) == 1 else None
    assert cache and cache.engaged and (cache.layers, cache.slots, cache.device) == (3, 5, "CPU"), engaged
    assert tokens == stock_tokens


def test_server_with_a_plans_placement(patched_build, cache_models, profiles, slots_on_cpu, tmp_path: Path) -> None:
    """The planner's flags for one whole layer, one partly resident and one in RAM: llama.cpp's
    loader puts exactly the last two layers' experts in RAM, the cache engages on the partly
    resident one alone, and the tokens are stock's."""
    from moeplug.model.inspect import inspect_model
    from moeplug.planner.server_flags import placement_args
    from moeplug.profile.format import read_profile

    model, profile = cache_models["qwen3moe"], profiles["qwen3moe"]
    info = inspect_model(model)
    placement = ["-ngl", "99", *placement_args(info, [N_EXPERT, 3, 0], read_profile(profile), profile)]
    stock_tokens, _ = serve_once(patched_build, model, tmp_path, "stock", [])
    tokens, log = serve_once(patched_build, model, tmp_path, "planned", [*placement, "-v"])
    overridden = sorted(set(re.findall(r"tensor (\S+) \(.*\) buffer type overridden to", log)))  # logged per load pass
    assert overridden == sorted(f"blk.{layer.block}.{name}" for layer in info.layers[1:] for name in layer.tensors), \
        overridden
    cache = parse_cache_line(log)
    assert cache and cache.engaged and (cache.layers, cache.slots, cache.whole_layers) == (1, 3, 0), log[-2000:]
    assert tokens == stock_tokens


def test_server_flags_from_environment(patched_build, cache_models, profiles, slots_on_cpu, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_MOE_CACHE_PROFILE", str(profiles["qwen3moe"]))
    monkeypatch.setenv("LLAMA_ARG_MOE_CACHE_SLOTS", "2,8,0")
    _, log = serve_once(patched_build, cache_models["qwen3moe"], tmp_path, "env", [])
    cache = parse_cache_line(log)
    assert cache and cache.engaged and (cache.layers, cache.slots_min, cache.slots, cache.whole_layers) == (2, 2, 8, 1), \
        log[-2000:]


def truncated(profile: Path, dest: Path) -> Path:
    data = profile.read_bytes()
    dest.write_bytes(data[: len(data) // 2])
    return dest


BAD_CASES = {
    "other model": (lambda p, tmp: p["hy_v3"], 3, "is of another model"),
    "truncated": (lambda p, tmp: truncated(p["qwen3moe"], tmp / "half.gguf"), 3, "cannot read the profile"),
    "missing": (lambda p, tmp: tmp / "nope.gguf", 3, "cannot read the profile"),
    "too many slots": (lambda p, tmp: p["qwen3moe"], N_EXPERT + 1, "the model has 8 experts per layer"),
    "zero slots": (lambda p, tmp: p["qwen3moe"], 0, "give at least 1 slot per layer"),
    "no layer": (lambda p, tmp: p["qwen3moe"], "0,0,0", "gives no layer a slot"),
    "list too short": (lambda p, tmp: p["qwen3moe"], "3,3", "2 counts given, the profile has 3 layers"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_profile_warns_once_and_runs_baseline(patched_build, cache_models, profiles, slots_on_cpu,
                                                  tmp_path: Path, case: str) -> None:
    make_profile, slots, reason = BAD_CASES[case]
    model = cache_models["qwen3moe"]
    stock_tokens, _ = serve_once(patched_build, model, tmp_path, "stock", [])
    tokens, log = serve_once(patched_build, model, tmp_path, "bad",
                             ["--moe-cache-profile", str(make_profile(profiles, tmp_path)), "--moe-cache-slots", str(slots)])
    lines = [line for line in log.splitlines() if "moe-cache:" in line]
    assert len(lines) == 1 and NOT_ENGAGED in lines[0] and reason in lines[0], lines
    assert tokens == stock_tokens


def test_malformed_slot_list_is_a_usage_error(patched_build, cache_models, profiles, tmp_path: Path) -> None:
    r = subprocess.run([str(patched_build.binary("llama-server")), "-m", str(cache_models["qwen3moe"]),
                        "--moe-cache-profile", str(profiles["qwen3moe"]), "--moe-cache-slots", "3,x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--moe-cache-slots 3,x: give N or one N per layer" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("share", ["1.5", "-0.1", "half"])
def test_stream_share_out_of_range_is_a_usage_error(patched_build, cache_models, profiles, share: str) -> None:
    r = subprocess.run([str(patched_build.binary("llama-server")), "-m", str(cache_models["qwen3moe"]),
                        "--moe-cache-profile", str(profiles["qwen3moe"]), "--moe-cache-stream", share],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "give a share from 0 to 1" in r.stderr, r.stderr[-2000:]


def test_no_gpu_layer_means_no_cache(patched_build, cache_models, profiles, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the debug switch a CPU build has no device to hold slots: a warning, a baseline run."""
    monkeypatch.delenv("LLAMA_MOE_CACHE_DEVICE", raising=False)
    _, log = serve_once(patched_build, cache_models["qwen3moe"], tmp_path, "cpu",
                        ["--moe-cache-profile", str(profiles["qwen3moe"]), "--moe-cache-slots", "3"])
    lines = [line for line in log.splitlines() if "moe-cache:" in line]
    assert len(lines) == 1 and NOT_ENGAGED in lines[0] and "the layer runs on the CPU" in lines[0], lines


def metrics_of(build, model: Path, profile: Path, slots: int, tmp_path: Path, name: str,
               prompt: str = "def fibonacci(n):", extra: tuple[str, ...] = ()) -> tuple[CacheCounters, dict]:
    """The moe_cache counters of llama-server's /metrics after one completion (moeplug.serving.metrics),
    and the completion."""
    import requests

    log = tmp_path / f"{name}.log"
    args = ["--metrics", "--moe-cache-profile", str(profile), "--moe-cache-slots", str(slots), *extra]
    with start_server(build.binary("llama-server"), model, log, extra_args=args, ctx=512, threads=2) as srv:
        srv.wait_healthy(timeout=120)
        reply = srv.complete(prompt, n_predict=16, ignore_eos=True)
        text = requests.get(f"{srv.url}/metrics", timeout=10).text
    c = parse_cache_counters(text)
    assert c is not None, text[-2000:]
    return c, reply


@pytest.mark.parametrize("case", ["all", "some", "none"])
def test_server_metrics_count_slot_hits(patched_build, cache_models, profiles, slots_on_cpu, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """/metrics: selections, slot hits, experts computed from host memory and their bytes, per layer."""
    if case == "none":
        monkeypatch.setenv("LLAMA_MOE_CACHE_NO_RESIDENT", "1")
    m, _ = metrics_of(patched_build, cache_models["qwen3moe"], profiles["qwen3moe"], N_EXPERT if case == "all" else 3,
                      tmp_path, case)
    assert len(m.layers) == 3 and m.selections == sum(v["selections"] for v in m.layers.values()) > 0
    assert m.hits == sum(v["hits"] for v in m.layers.values())
    assert m.hits + m.cpu_experts == m.selections
    if case == "all":
        assert m.hits == m.selections and m.cpu_bytes == 0
    elif case == "none":
        assert m.hits == 0 and m.cpu_bytes > 0
    else:
        assert 0 < m.hits < m.selections and m.cpu_bytes > 0


def test_max_batch_decides_which_batches_take_the_slots(patched_build, cache_models, profiles, slots_on_cpu,
                                                       tmp_path: Path) -> None:
    """A prompt of more than 31 tokens is one batch above the default max batch: the stock graph,
    not counted; with --moe-cache-max-batch 512 it takes the slots, and every prompt token's expert
    selections are counted (but in the last layer, which computes only the row that gives logits).
    The tokens are the same."""
    from moeplug.profile.format import read_profile

    model, profile = cache_models["qwen3moe"], profiles["qwen3moe"]
    n_layers = len(read_profile(profile).tensors)
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 3
    default, reply = metrics_of(patched_build, model, profile, 3, tmp_path, "default", prompt)
    large, reply_large = metrics_of(patched_build, model, profile, 3, tmp_path, "large", prompt,
                                    ("--moe-cache-max-batch", "512"))
    n_prompt = reply["timings"]["prompt_n"]
    assert n_prompt > 31 and reply_large["timings"]["prompt_n"] == n_prompt
    assert reply_large["tokens"] == reply["tokens"]
    assert default.selections > 0 and set(large.layers) == set(default.layers) == set(range(n_layers))
    for il, counts in large.layers.items():  # the same decode batches, plus the prompt's
        # the last layer computes only the rows that give logits: one token of the prompt, in both runs
        prompt_rows = n_prompt if il < n_layers - 1 else 0
        assert counts["selections"] - default.layers[il]["selections"] == FIXTURE_SHAPE["used"] * prompt_rows


def test_the_server_fills_its_slots_as_the_planner_ranks(patched_build, cache_models, profiles, slots_on_cpu,
                                                         tmp_path: Path) -> None:
    """One ranking on each side: llama-server fills each layer's slots from a profile with the experts
    moeplug.planner.allocate.slot_order ranks first (generated tokens' selections, then the prompts',
    then the lower id), the ranking the planner's hit curves use. A profile whose prompt tokens favour
    the other half of the experts: on a recorded completion (every batch through the slots), each layer's
    slot hits are exactly the recorded selections of slot_order's experts, and not those of the experts
    a ranking by all selections would have put there."""
    import numpy as np
    import requests

    from moeplug.planner.allocate import served_share
    from moeplug.profile.format import read_profile, write_profile

    real = read_profile(profiles["qwen3moe"])
    n_layers, n = real.counts_decode.shape
    half = n // 2
    decode, prefill = np.zeros_like(real.counts_decode), np.zeros_like(real.counts_prefill)
    decode[:, :half] = np.arange(half, 0, -1) * 10  # generated tokens: the first half, fewer selections
    prefill[:, half:] = 1000  # prompt tokens: the second half
    crafted = replace(real, counts_decode=decode, counts_prefill=prefill, sources=[])
    path = write_profile(crafted, tmp_path / "crafted.profile.gguf")
    args = ["--metrics", "--moe-cache-record", "--moe-cache-profile", str(path), "--moe-cache-slots", str(half),
            "--moe-cache-max-batch", "512"]
    with start_server(patched_build.binary("llama-server"), cache_models["qwen3moe"], tmp_path / "ranked.log",
                      extra_args=args, ctx=512, threads=2) as srv:
        srv.wait_healthy(timeout=120)
        srv.complete("def fibonacci(n):\n    return n", n_predict=24, ignore_eos=True)
        counters = parse_cache_counters(requests.get(f"{srv.url}/metrics", timeout=10).text)
        recorded = tmp_path / "recorded.gguf"
        recorded.write_bytes(requests.get(f"{srv.url}/moe-cache/profile", timeout=10).content)
    assert counters is not None
    traffic = read_profile(recorded).counts_prefill + read_profile(recorded).counts_decode
    measured = [counters.layers[il]["hits"] / counters.layers[il]["selections"] for il in range(n_layers)]
    assert [counters.layers[il]["selections"] for il in range(n_layers)] == [int(t.sum()) for t in traffic]
    assert measured == pytest.approx(served_share(crafted, [half] * n_layers, traffic), abs=1e-12)
    by_all = [traffic[il][np.argsort(-(decode + prefill)[il], kind="stable")[:half]].sum() / traffic[il].sum()
              for il in range(n_layers)]
    assert by_all != pytest.approx(measured, abs=1e-12)
