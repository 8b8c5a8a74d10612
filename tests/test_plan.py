"""The slot planner: its arithmetic against what a real llama-server allocates, and its warnings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from moeplug.errors import MoeplugError
from moeplug.model_inspect import inspect_model
from moeplug.plan import (CUDA_POOL_HEADROOM, SAFETY_MARGIN, compute_buffer_bytes, kv_cache_bytes, make_plan,
                          parse_size, predicted_hit_rate, stock_ncmoe)
from moeplug.serving import parse_buffers
from moeplug.server import start_server

MIB = 1 << 20


@pytest.mark.parametrize("text,value", [("12GiB", 12 << 30), ("12G", 12 << 30), ("8000MiB", 8000 << 20),
                                        ("1.5 GiB", int(1.5 * (1 << 30))), ("4096", 4096)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_rejects_nonsense() -> None:
    with pytest.raises(MoeplugError, match="is not a size"):
        parse_size("twelve gigs")


def fixed_bytes(info, ctx: int) -> int:
    return info.non_expert_bytes + kv_cache_bytes(info, ctx) + compute_buffer_bytes(info) + CUDA_POOL_HEADROOM + \
        SAFETY_MARGIN


@pytest.mark.parametrize("arch", ["qwen3moe", "hy_v3", "gpt-oss"])
def test_slots_fill_the_budget(fixture_models, arch: str) -> None:
    info = inspect_model(fixture_models[arch])
    per_slot = sum(layer.bytes_per_expert for layer in info.layers)
    for n in (1, 3, 5):
        budget = fixed_bytes(info, 2048) + n * per_slot + per_slot // 2
        plan = make_plan(info, 2048, budget)
        assert plan.slots_per_layer == n
        assert plan.expert_vram_bytes == n * per_slot
        args = plan.server_args
        assert "--cpu-moe" in args and args[args.index("--moe-cache-slots") + 1] == str(n)
    full = make_plan(info, 2048, fixed_bytes(info, 2048) + 100 * per_slot)
    assert full.slots_per_layer == info.n_expert and "--cpu-moe" not in full.server_args


def test_warnings_at_20_and_15_percent(tmp_path: Path) -> None:
    from moeplug.synth import ModelSpec, make_model

    path = make_model(ModelSpec(arch="qwen3moe", layers=2, experts=20, used=2, embd=64, expert_ff=64,
                                   dtype="f16", seed=3), tmp_path / "m20.gguf")[0]
    info = inspect_model(path)
    per_slot = sum(layer.bytes_per_expert for layer in info.layers)

    def plan_with(n: int):
        return make_plan(info, 1024, fixed_bytes(info, 1024) + n * per_slot)

    assert plan_with(5).warnings == []  # 25%
    assert plan_with(4).warnings == []  # 20%: at the threshold, not below
    w = plan_with(3).warnings  # 15%
    assert len(w) == 1 and "below 20%" in w[0]
    w = plan_with(2).warnings  # 10%
    assert len(w) == 1 and "below 15%" in w[0] and "--cpu-moe speed" in w[0]


def test_predicted_hit_rate_reads_the_profile() -> None:
    decode = np.array([[10, 5, 1, 0], [0, 0, 8, 8]])
    assert predicted_hit_rate(decode, decode, 1) == pytest.approx((10 + 8) / 32)
    assert predicted_hit_rate(decode, decode, 2) == pytest.approx((15 + 16) / 32)
    assert predicted_hit_rate(np.zeros((2, 4)), decode, 1) == pytest.approx(18 / 32)  # no decode: prefill


def test_stock_ncmoe_keeps_the_last_layers_on_the_gpu(fixture_models) -> None:
    info = inspect_model(fixture_models["hy_v3"])  # block 0 is dense: MoE blocks 1 and 2
    layer = info.layers[0].expert_bytes
    assert stock_ncmoe(info, 2 * layer) == 0
    assert stock_ncmoe(info, layer) == 2  # experts of blocks 0-1 in RAM, block 2's on the GPU
    assert stock_ncmoe(info, 0) == info.n_layer


def test_budget_too_small_is_a_clear_error(fixture_models) -> None:
    info = inspect_model(fixture_models["qwen3moe"])
    with pytest.raises(MoeplugError, match="does not hold the model's other weights"):
        make_plan(info, 2048, 64 * MIB)


@pytest.mark.native
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_arithmetic_matches_llama_server_buffers(patched_build, fixture_models, tmp_path: Path, arch: str) -> None:
    """KV cache and weights as the planner counts them are what llama-server allocates; the
    compute estimate covers the compute buffer it reserves."""
    model, ctx = fixture_models[arch], 1024
    info = inspect_model(model)
    with start_server(patched_build.binary("llama-server"), model, tmp_path / "srv.log", ctx=ctx, threads=2,
                      extra_args=["-np", "1", "-lm", "none", "-lv", "4"]) as srv:
        srv.wait_healthy()
    buffers = parse_buffers((tmp_path / "srv.log").read_text())
    kv = sum(buffers["KV"].values()) * MIB
    if arch == "gpt-oss":  # sliding-window layers keep less than ctx: the planner counts an upper bound
        assert 0.5 * kv_cache_bytes(info, ctx) <= kv <= kv_cache_bytes(info, ctx)
    else:
        assert kv == pytest.approx(kv_cache_bytes(info, ctx), abs=0.01 * MIB)
    weights = sum(buffers["model"].values()) * MIB
    assert weights == pytest.approx(info.total_bytes, rel=0.02)
    compute = sum(buffers["compute"].values()) * MIB
    assert compute <= compute_buffer_bytes(info) <= 8 * compute + 64 * MIB


def test_cli_plan_json(fixture_models) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", "2GiB", "--ctx", "2048", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in ("slots_per_layer", "fit_fraction", "vram_budget_bytes", "expert_vram_bytes", "predicted_hit_rate",
                "warnings", "stock_ncmoe", "server_args"):
        assert key in doc, key
    assert doc["vram_budget_bytes"] == 2 << 30 and doc["slots_per_layer"] == 8


def test_cli_plan_without_gpu_is_a_cpu_plan(fixture_models) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    if doc["backend"] == "cpu":  # this machine has no NVIDIA GPU
        assert doc["slots_per_layer"] == 0 and any("no NVIDIA GPU" in n for n in doc["notes"])


def test_cli_plan_bad_budget(fixture_models) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", "lots")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "is not a size" in r.stderr
