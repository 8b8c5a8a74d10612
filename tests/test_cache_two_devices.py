"""The expert slot cache with the model's layers split over two devices, without a GPU: two RPC
devices backed by the CPU (the `rpc_devices` fixture), `-sm layer -ts 1,1`, every routed expert in
host memory. Each layer's slots live on that layer's device and every expert is computed by the
CPU's kernels wherever it sits, so the results must be stock's on the same split, bit for bit;
the log names both devices, and /metrics counts per device."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from helpers import fixture_spec, make_profile
from moeplug.serving.metrics import parse_cache_counters
from moeplug.serving.server import start_server
from moeplug.serving.launch import parse_cache_line
from moeplug.model.synth import make_model

pytestmark = pytest.mark.native

EXPERTS_IN_RAM = ["-ot", r"blk\.[0-9]+\.ffn_(up|down|gate|gate_up)_exps=CPU"]
SPLIT = ["-ngl", "99", "-sm", "layer", "-ts", "1,1"]


@pytest.fixture(scope="module")
def split_models(tmp_path_factory: pytest.TempPathFactory, patched_build) -> dict[str, tuple[Path, Path]]:
    """qwen3moe and gpt-oss (expert biases) with 4 MoE layers, and a real profile of each."""
    root = tmp_path_factory.mktemp("split-models")
    out = {}
    for arch in ("qwen3moe", "gpt-oss"):
        model = make_model(replace(fixture_spec(arch), layers=4), root / f"{arch}-4.gguf")[0]
        out[arch] = (model, make_profile(patched_build, model, root / f"{arch}-4.profile.gguf", 16))
    return out


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("slots,policy,overlap", [("3", "static", True), ("8,8,3,3", "static", True),
                                                  ("3", "dynamic", True), ("3", "dynamic", False)])
def test_slots_on_two_devices_are_bitwise_stock(patched_build, rpc_devices, split_models, arch: str, slots: str,
                                                policy: str, overlap: bool) -> None:
    """test-moe-cache on the split: 100 prompt tokens in ubatches of 7 and 64 greedy tokens, every
    logit equal to the same split without the cache; slots on RPC0 and RPC1. The slots being on
    devices, each layer's device pass is queued before the CPU computes its misses, and the CPU
    computes them beside it (LLAMA_MOE_CACHE_OVERLAP=0: one after the other, as before)."""
    model, profile = split_models[arch]
    cmd = [str(patched_build.binary("test-moe-cache")), *rpc_devices["args"], "-m", str(model),
           "--moe-cache-profile", str(profile), "--moe-cache-slots", slots, "--moe-cache-policy", policy,
           "-ub", "7", "-n", "64", "-t", "2", *SPLIT, *EXPERTS_IN_RAM]
    env = os.environ | rpc_devices["env"] | ({} if overlap else {"LLAMA_MOE_CACHE_OVERLAP": "0"})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
    cache = parse_cache_line(r.stderr)
    assert cache and cache.engaged, r.stderr[-2000:]
    assert cache.device == "RPC0, RPC1" and cache.layers == 4
    assert f"policy {policy}" in r.stderr
    # every partly resident layer overlaps (the line counts them), none with LLAMA_MOE_CACHE_OVERLAP=0
    assert cache.whole_layers == (2 if slots == "8,8,3,3" else 0)
    assert cache.overlapped_layers == (cache.layers - cache.whole_layers if overlap else 0), r.stderr[-2000:]
    assert "sched_timeline" not in r.stderr  # nothing timed unless GGML_SCHED_TIMELINE asks


def test_misses_read_in_place_only_from_the_devices_own_host_memory(patched_build, rpc_devices, split_models) -> None:
    """LLAMA_MOE_CACHE_DIRECT=1 (patch 0026) has a device compute a layer's misses too, reading them where
    they sit, only where they sit in that device's own host memory (pinned CUDA_Host on a GPU). An RPC device has
    none: no layer reads in place, the layers overlap as without the variable, and the logits stay bitwise stock's."""
    model, profile = split_models["qwen3moe"]
    cmd = [str(patched_build.binary("test-moe-cache")), *rpc_devices["args"], "-m", str(model),
           "--moe-cache-profile", str(profile), "--moe-cache-slots", "3", "--moe-cache-policy", "dynamic",
           "-ub", "7", "-n", "32", "-t", "2", *SPLIT, *EXPERTS_IN_RAM]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=os.environ | rpc_devices["env"] | {"LLAMA_MOE_CACHE_DIRECT": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
    cache = parse_cache_line(r.stderr)
    assert cache and cache.engaged and cache.device == "RPC0, RPC1", r.stderr[-2000:]
    assert cache.direct_layers == 0 and "in place" not in r.stderr
    assert cache.overlapped_layers == cache.layers == 4


TIMELINE = re.compile(r"ggml_backend_sched_timeline_report: (\d+) graphs of (\d+) splits, host us per graph: "
                      r"([\d.]+) in splits \(inputs ([\d.]+), compute ([\d.]+)\); synchronize ([\d.]+) us per call "
                      r"\((\d+) calls\)")
TIMELINE_SPLIT = re.compile(r"ggml_backend_sched_timeline_report: split +(\d+) (\S+) +(\d+) nodes +(\d+) inputs: "
                            r"inputs +([\d.]+) us, compute +([\d.]+) us \[(.*)\]")


def test_sched_timeline_times_each_split(patched_build, rpc_devices, split_models) -> None:
    """GGML_SCHED_TIMELINE=16 (patch 0024): every 16 graphs of as many splits, the host's time per
    split (waiting and queuing its inputs, then queuing or computing its nodes) and in synchronize, a
    line per split naming its backend; the per-split means add up to the graph's, and the logits stay
    bitwise stock's. Here the CPU computes each partly resident layer's misses in splits of its own."""
    model, profile = split_models["qwen3moe"]
    cmd = [str(patched_build.binary("test-moe-cache")), *rpc_devices["args"], "-m", str(model),
           "--moe-cache-profile", str(profile), "--moe-cache-slots", "3", "-ub", "7", "-n", "64", "-t", "2",
           *SPLIT, *EXPERTS_IN_RAM]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=os.environ | rpc_devices["env"] | {"GGML_SCHED_TIMELINE": "16"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
    lines = r.stderr.splitlines()
    reports = [(i, m) for i, line in enumerate(lines) if (m := TIMELINE.search(line))]
    assert len(reports) >= 4, r.stderr[-3000:]  # 64 decoded tokens alone make four reports
    for i, m in reports:
        n_graphs, n_splits = int(m[1]), int(m[2])
        total, inputs, compute = float(m[3]), float(m[4]), float(m[5])
        assert n_graphs == 16 and n_splits > 1 and total > 0
        assert total == pytest.approx(inputs + compute, abs=0.2)
        splits = [TIMELINE_SPLIT.search(line) for line in lines[i + 1:i + 1 + n_splits]]
        assert all(splits), lines[i:i + 1 + n_splits]
        assert [int(s[1]) for s in splits] == list(range(n_splits))
        names = {s[2] for s in splits}  # the two RPC devices' backends and the CPU
        assert "CPU" in names and len(names) == 3 and all(n.startswith("RPC") for n in names - {"CPU"}), names
        assert sum(float(s[5]) for s in splits) == pytest.approx(inputs, abs=0.1 * n_splits)
        assert sum(float(s[6]) for s in splits) == pytest.approx(compute, abs=0.1 * n_splits)
        assert any(s[2] == "CPU" and s[7].startswith("ffn_moe") for s in splits)  # the misses' pass


def test_metrics_count_per_device(patched_build, rpc_devices, split_models, tmp_path: Path) -> None:
    """llama-server on the split with --metrics: selections and hits per device add up to the
    totals, and both devices served requests."""
    model, profile = split_models["qwen3moe"]
    args = [*rpc_devices["args"], "--metrics", "--moe-cache-profile", str(profile), "--moe-cache-slots", "3",
            *SPLIT, *EXPERTS_IN_RAM]
    with start_server(patched_build.binary("llama-server"), model, tmp_path / "server.log", extra_args=args,
                      ctx=512, threads=2, env=rpc_devices["env"]) as srv:
        srv.wait_healthy(timeout=180)
        srv.complete(list(range(40, 60)), n_predict=24, ignore_eos=True)
        c = parse_cache_counters(requests.get(f"{srv.url}/metrics", timeout=10).text)
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert parse_cache_line(log).device == "RPC0, RPC1", log[-2000:]
    assert c is not None and set(c.devices) == {"RPC0", "RPC1"}
    assert sum(d["selections"] for d in c.devices.values()) == c.selections > 0
    assert sum(d["hits"] for d in c.devices.values()) == c.hits
    assert all(d["selections"] > 0 for d in c.devices.values())
