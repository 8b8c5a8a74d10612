"""The expert slot cache on a Vulkan device, without a GPU: the patched Vulkan build (`moeplug native
build --vulkan`) on Mesa's software Vulkan driver, lavapipe, which llama.cpp lists only when named
(GGML_VK_VISIBLE_DEVICES=0).

Where bitwise equality holds on a Vulkan device: with every expert op on the device, each (expert,
token) row is computed by the same Vulkan kernel whichever pass computes it, and the other pass gives
an exact zero for it (patch 0028: the shaders honour negative expert ids as the CPU's and CUDA's kernels
do). So with GGML_OP_OFFLOAD_MIN_BATCH=1, which sends every expert op on host weights to the device (the
scheduler copying the experts it selects), the cache with its slots in VRAM gives the logits of stock on
the same build with the experts in RAM, bit for bit: static and dynamic, through the mat-vec kernels
(ubatches of 7) and the matmul ones (64). Served, the misses run on the CPU beside the slots: the demo's
install checks that path end to end.

lavapipe 22.3 (Debian 12) faults in its command thread (a call through a null pointer) on some 64-token
batches that no negative id takes part in (stock full offload against the cache with every expert
resident), and on the dynamic slots' 64-token batches; the dynamic policy is checked through the mat-vec
kernels here. In one process, long runs of test-backend-ops' negative-id cases have corrupted its heap
now and then, which the same cases run by weight type never did: they run one process per type.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import requests

from helpers import fixture_spec, make_profile, moeplug, xdg_homes
from moeplug.machine.backend import Backend
from moeplug.machine.devices import listed_gpus
from moeplug.model.synth import make_model
from moeplug.serving.launch import parse_cache_line

pytestmark = pytest.mark.native

LAVAPIPE = {"GGML_VK_VISIBLE_DEVICES": "0"}
EXPERTS_IN_RAM = ["-ngl", "99", "-ot", r"blk\.[0-9]+\.ffn_(up|down|gate|gate_up)_exps=CPU"]


@pytest.fixture(scope="module")
def vk_models(tmp_path_factory: pytest.TempPathFactory, vulkan_build) -> dict[str, tuple[Path, Path]]:
    """qwen3moe and gpt-oss (expert biases: ADD_ID) with 4 MoE layers, and a real profile of each."""
    root = tmp_path_factory.mktemp("vulkan-models")
    out = {}
    for arch in ("qwen3moe", "gpt-oss"):
        model = make_model(replace(fixture_spec(arch), layers=4), root / f"{arch}-4.gguf")[0]
        out[arch] = (model, make_profile(vulkan_build, model, root / f"{arch}-4.profile.gguf", 16))
    return out


def test_llama_cpp_lists_lavapipe_once_named(vulkan_build) -> None:
    """The Vulkan build sees no device by default (lavapipe is of the CPU type), and the device list
    names it once asked by index: its name and memory, the environment the server needs."""
    listed = listed_gpus(vulkan_build.binary("llama-server"), Backend.VULKAN)
    assert listed.software and listed.env == LAVAPIPE, listed
    [gpu] = listed.gpus
    assert gpu.device == "Vulkan0" and "llvmpipe" in gpu.name and 0 < gpu.free_bytes <= gpu.total_bytes


# test-backend-ops' cases of patch 0010, one process per weight type and broadcast (see above)
OP_CASES = ([("MUL_MAT_ID_SKIP_NEG", f"type_a={t},.*,b=0,") for t in ("f16", "f32", "bf16", "q4_0", "q8_0", "q4_K",
                                                                    "q6_K", "mxfp4", "iq4_xs")]
            + [("MUL_MAT_ID_SKIP_NEG", f"type_a={t},.*,b=1,") for t in ("f16", "q4_0", "q4_K", "mxfp4")]
            + [("MUL_MAT_VEC_FUSION_SKIP_NEG", f"type={t},.*,b={b},") for t in ("f16", "q4_0", "q4_K", "q8_0")
               for b in (0, 1)]
            + [("MUL_MAT_VEC_FUSION_SKIP_NEG", "type=mxfp4,"), ("ADD_ID_SKIP_NEG", ".*")])


@pytest.mark.parametrize("op,params", OP_CASES)
def test_the_shaders_give_exact_zeros_for_negative_ids(vulkan_build, op: str, params: str) -> None:
    """test-backend-ops on Vulkan0 against the CPU: MUL_MAT_ID with 0%, 30% and all ids negative over nine
    weight types and batches 1-129 (every negative id's row exactly zero), also with the activations
    broadcast to the experts; the fused gate/up/bias/glu graphs on both sides of the mat-vec kernels' batch
    limit; ADD_ID bitwise."""
    r = subprocess.run([str(vulkan_build.binary("test-backend-ops")), "-b", "Vulkan0", "-o", op, "-p", params],
                       capture_output=True, text=True, timeout=900, env=os.environ | LAVAPIPE)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = re.search(r"(\d+)/(\d+) tests passed", r.stdout)
    assert passed and passed[1] == passed[2] and int(passed[2]) > 0, r.stdout[-3000:]


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("slots,policy,ubatch", [("3", "static", 7), ("3", "dynamic", 7), ("8,8,3,3", "static", 7),
                                                  ("3", "static", 64)])
def test_slots_on_vulkan_are_bitwise_stock(vulkan_build, vk_models, arch: str, slots: str, policy: str,
                                           ubatch: int) -> None:
    """test-moe-cache: 100 prompt tokens in ubatches of 7 (the mat-vec kernels) or 64 (the matmul kernels,
    through the cache's two passes: --moe-cache-max-batch 64) and 32 greedy tokens, every logit equal to
    stock's on the same build with every expert op on Vulkan0; the slots in VRAM, the misses' experts
    copied to the device by the scheduler."""
    model, profile = vk_models[arch]
    cmd = [str(vulkan_build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile", str(profile),
           "--moe-cache-slots", slots, "--moe-cache-policy", policy, "--moe-cache-max-batch", str(ubatch),
           "-ub", str(ubatch), "-n", "32", "-t", "2", *EXPERTS_IN_RAM]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env=os.environ | LAVAPIPE | {"GGML_OP_OFFLOAD_MIN_BATCH": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
    cache = parse_cache_line(r.stderr)
    assert cache and cache.engaged and cache.device == "Vulkan0" and cache.layers == 4, r.stderr[-2000:]
    assert cache.whole_layers == (2 if slots == "8,8,3,3" else 0) and f"policy {policy}" in r.stderr
    assert cache.streamed_layers == 0 and cache.direct_layers == 0


def test_the_bitwise_check_sees_two_kernels_apart(vulkan_build, vk_models) -> None:
    """The same comparison fails where the two sides compute some experts with different kernels (the
    cache's slots on Vulkan0, stock's every expert on the CPU for a decoded token): what the bitwise test
    above would see of a pass that computed its negative ids' rows, or of a slot on the wrong weights."""
    model, profile = vk_models["qwen3moe"]
    cmd = [str(vulkan_build.binary("test-moe-cache")), "-m", str(model), "--moe-cache-profile", str(profile),
           "--moe-cache-slots", "3", "-ub", "7", "-n", "4", "-t", "2", *EXPERTS_IN_RAM]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=os.environ | LAVAPIPE)
    assert r.returncode == 1 and "test-moe-cache: FAIL" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_install_demo_on_vulkan_serves_and_answers(vulkan_build, tmp_path: Path) -> None:
    """`moeplug install demo --backend vulkan` on lavapipe: a plan for Vulkan0 with a quarter of the
    demo's experts in slots, served with the device named, answering; status shows the slots on Vulkan0."""
    home = xdg_homes(tmp_path)
    r = moeplug(home, "install", "demo", "--backend", "vulkan", "--ctx", "1024", "--no-check", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    try:
        plan, srv = doc["plan"], doc["server"]
        assert plan["backend"] == "vulkan" and plan["device_env"] == LAVAPIPE, plan
        assert srv["cache"]["engaged"] and srv["cache"]["device"] == "Vulkan0", srv["cache"]
        assert any(n.startswith("on Vulkan the slots") for n in plan["notes"])
        answer = requests.post(f"{srv['url']}/completion", json={"prompt": "def main():", "n_predict": 8,
                                                                 "temperature": 0, "cache_prompt": False},
                               timeout=300)
        assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 8, answer.text[:500]
        status = moeplug(home, "status")
        assert status.returncode == 0 and "on Vulkan0" in status.stdout, status.stdout
        [served] = json.loads(moeplug(home, "status", "--json").stdout)["servers"]
        assert served["healthy"] and served["cache"]["device"] == "Vulkan0"
    finally:
        assert moeplug(home, "stop", "demo").returncode == 0
