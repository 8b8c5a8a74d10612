"""Two GPUs: llama.cpp's layer split reproduced (moeplug.planner.split), the per-GPU plan (moeplug.planner.multi_gpu)
within each budget, and --vram-budget's list form.

The split arithmetic is checked against hand-worked cases of llama.cpp's own formula
(src/llama-model.cpp, llama_model_base::load_tensors: cumulative `tensor_split` points normalised
in float32, `i_gpu_start`, `act_gpu_layers`, `std::upper_bound` of `float(il - i_gpu_start) /
act_gpu_layers`), and against the assignment llama.cpp itself prints: llama-fit-params of the
patched CPU build loads the model onto two RPC devices (two local rpc-server processes backed by
the CPU, built here from the build's own source tree) and logs `layer N assigned to device RPCk`.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import fixture_spec, layer_costs_of, make_profile, plan_with, run_cli
from moeplug.core.errors import MoeplugError
from moeplug.planner.estimates import compute_buffer_bytes, expert_copy_ahead_bytes, kv_cache_bytes, nextn_layers
from moeplug.machine.gpu import GpuInfo, one_budget_note, vram_budgets
from moeplug.model.inspect import inspect_model
from moeplug.planner.allocate import allocate
from moeplug.planner.record import Plan
from moeplug.profile.format import read_profile
from moeplug.planner.speculation import Speculation, draft_compute_bytes
from moeplug.planner.split import layer_devices, split_for
from moeplug.model.synth import make_model
from moeplug.planner.costs import DEFAULT_COSTS

MIB = 1 << 20


def runs(devices: list[int | None]) -> dict[int | None, tuple[int, int]]:
    """device -> (first layer, last layer) of each device's layers (layer n_layer is the output layer)."""
    out: dict[int | None, list[int]] = {}
    for il, d in enumerate(devices):
        out.setdefault(d, []).append(il)
    assert all(v == list(range(v[0], v[-1] + 1)) for v in out.values()), "a device's layers are not contiguous"
    return {d: (v[0], v[-1]) for d, v in out.items()}


# 48 blocks + the output layer = 49 layers; -ngl 99 (moeplug's) covers all: i_gpu_start 0, act 49.
# Layer il goes to the first device whose split point exceeds il/49.
@pytest.mark.parametrize("proportions,expected", [
    # points 1/2, 1: il/49 < 0.5 for il <= 24 (24/49 = 0.4898, 25/49 = 0.5102)
    ([1, 1], {0: (0, 24), 1: (25, 48)}),
    # points 3/4, 1: il/49 < 0.75 for il <= 36 (36/49 = 0.7347, 37/49 = 0.7551)
    ([3, 1], {0: (0, 36), 1: (37, 48)}),
    # float32(0.4) + float32(0.6) rounds to 1.0f: points 0.4f = 0.40000001, 1; il/49 < 0.4 for il <= 19
    ([0.4, 0.6], {0: (0, 19), 1: (20, 48)}),
    # a zero share: every layer on the other device
    ([1, 0], {0: (0, 48)}),
    ([0, 1], {1: (0, 48)}),
])
def test_split_of_48_blocks_as_llama_cpp_computes_it(proportions: list[float], expected: dict) -> None:
    assert runs(layer_devices(48, proportions, 99)) == expected


def test_split_with_fewer_gpu_layers_keeps_the_first_blocks_on_the_cpu() -> None:
    """-ngl 48 of 49 layers: i_gpu_start = 1 (block 0 on the CPU), act_gpu_layers = 48; the output
    layer still on the last GPU. -ts 1,1: (il-1)/48 < 0.5 for il <= 24; il = 25 gives exactly 0.5,
    which is not above the point 0.5: upper_bound sends it to device 1. -ngl 0: everything on the CPU."""
    assert runs(layer_devices(48, [1, 1], 48)) == {None: (0, 0), 0: (1, 24), 1: (25, 48)}
    assert runs(layer_devices(48, [3, 1], 10)) == {None: (0, 38), 0: (39, 46), 1: (47, 48)}  # (il-39)/10 < 0.75
    assert runs(layer_devices(48, [1, 1], 0)) == {None: (0, 48)}


def test_split_rounds_in_float32_like_llama_cpp() -> None:
    """47 blocks, -ts 0.7,0.9: the exact point 0.7/1.6 = 7/16 equals 21/48, so exact arithmetic sends
    layer 21 to device 1. In float32, 0.7f + 0.9f = 1.6f = 1.60000002 and 0.7f = 0.69999999, so the
    point is 0.43749997 < float(21)/48 = 0.4375: llama.cpp puts layer 21 on device 0 as well (the RPC
    test below sees llama.cpp do it)."""
    devices = layer_devices(47, [0.7, 0.9])
    assert runs(devices) == {0: (0, 21), 1: (22, 47)}


@pytest.mark.parametrize("n_layer", [3, 24, 47, 48, 94])
def test_split_for_puts_exactly_k_layers_first(n_layer: int) -> None:
    for k in range(n_layer + 2):
        assert layer_devices(n_layer, split_for(n_layer, k)) == [0] * k + [1] * (n_layer + 1 - k)


def test_split_refuses_nonsense() -> None:
    for bad in ([0, 0], [], [-1, 2]):
        with pytest.raises(ValueError):
            layer_devices(48, bad)


# ---------------------------------------------------------------------------------------------
# --vram-budget with one budget per GPU


def gpu(index: int, free: int) -> GpuInfo:
    return GpuInfo(index, "test GPU", 2 * free, free, free, None, "90")


def test_budgets_against_the_gpus_found() -> None:
    two = [gpu(0, 10 << 30), gpu(1, 11 << 30)]
    assert vram_budgets(None, two) == [10 << 30, 11 << 30]  # no budget: each GPU's free memory
    assert vram_budgets(None, two[:1]) == 10 << 30  # one GPU: one int, as before
    assert vram_budgets(None, []) is None
    assert vram_budgets(5 << 30, two) == 5 << 30
    assert vram_budgets([1, 2], []) == [1, 2]  # GPUs unknown: taken as given
    with pytest.raises(MoeplugError, match="gives 2 budgets but this machine has 1 NVIDIA GPU") as exc:
        vram_budgets([1 << 30, 1 << 30], two[:1])
    assert exc.value.exit_code == 2
    assert "llama.cpp spreads the layers over every GPU" in (one_budget_note(5 << 30, two) or "")
    assert one_budget_note(5 << 30, two[:1]) is None and one_budget_note([1, 2], two) is None


@pytest.mark.parametrize("budget,message", [("12GiB,,3", "has an empty budget"), ("0,12GiB", "0 is out of range"),
                                            ("12GiB,0", "0 is out of range"), ("1GiB,", "has an empty budget"),
                                            ("1GiB,2GiB,3GiB", "gives 3 budgets"), ("1GiB,lots", "is not a size")])
def test_cli_refuses_bad_budget_lists(fixture_models, budget: str, message: str) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", budget)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr and "--vram-budget" in r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------------------------
# the per-GPU plan


@pytest.fixture(scope="module")
def eight_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture shape with 8 blocks: enough for a split to have choices."""
    return make_model(replace(fixture_spec("qwen3moe"), layers=8), tmp_path_factory.mktemp("m8") / "m8.gguf")[0]


def fixed_per_gpu(info, ctx: int) -> int:
    """What every GPU holds besides its blocks: the compute buffer, the CUDA pool and the margin."""
    return compute_buffer_bytes(info) + DEFAULT_COSTS.cuda_pool_headroom + DEFAULT_COSTS.safety_margin


def check_within_budgets(plan: Plan, info, ctx: int, budgets: list[int], draft=None,
                         mtp: bool = False) -> list[int | None]:
    """The layer placement llama.cpp makes of the plan's flags, and each GPU's bytes recounted from the
    model's tensors under it: within its budget, and what the plan says. draft: the draft model's
    ModelInfo, whose layers llama.cpp splits by the same --tensor-split over its own blocks; mtp:
    the NextN blocks are the draft's, whole, with their KV cache, on the GPU the split gives them."""
    args = plan.server_args
    assert args[args.index("-sm") + 1] == "layer"
    proportions = [float(x) for x in args[args.index("--tensor-split") + 1].split(",")]
    devices = layer_devices(info.n_layer, proportions, int(args[args.index("-ngl") + 1]))
    assert None not in devices and devices == sorted(devices)  # every layer on a GPU, GPU 0's first
    n_trunk = info.n_layer - nextn_layers(info)
    nextn = set(range(n_trunk, info.n_layer)) if mtp else set()
    experts = {f"blk.{layer.block}.{key}" for layer in info.layers for key in layer.tensors}
    used = [fixed_per_gpu(info, ctx)] * len(budgets)
    drafted = [0] * len(budgets)
    for t in info.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m[1]) in nextn:
            drafted[devices[int(m[1])]] += t.n_bytes  # the MTP head's block, experts included
        elif t.name not in experts:
            used[devices[int(m[1])] if m else devices[-1]] += t.n_bytes  # outside the blocks: the output's GPU
    for block in range(n_trunk):
        used[devices[block]] += kv_cache_bytes(info, ctx) // n_trunk
    for block in nextn:
        drafted[devices[block]] += kv_cache_bytes(info, ctx, mtp=True) // len(nextn)
    for d in {devices[b] for b in nextn}:
        drafted[d] += draft_compute_bytes(info)
    if draft is not None:
        where = layer_devices(draft.n_layer, proportions, int(args[args.index("-ngld") + 1]))
        for t in draft.tensors:
            m = re.match(r"blk\.(\d+)\.", t.name)
            drafted[where[int(m[1])] if m else where[-1]] += t.n_bytes
        for block in range(draft.n_layer):
            drafted[where[block]] += kv_cache_bytes(draft, ctx) // draft.n_layer
        for d in set(where):
            drafted[d] += draft_compute_bytes(draft)
    for layer, n in zip(info.layers, plan.slots_per_layer):
        if layer.block in nextn:
            assert n == info.n_expert  # a whole layer, counted in the draft's weights
        else:
            used[devices[layer.block]] += n * layer.bytes_per_expert
    # with a profile, the first GPU's prompt batches copy experts ahead where its layers keep experts in RAM
    first = [layer for layer in info.layers if devices[layer.block] == 0 and layer.block not in nextn]
    slots_of = dict(zip((layer.block for layer in info.layers), plan.slots_per_layer))
    if plan.profile and any(slots_of[layer.block] < info.n_expert for layer in first):
        used[0] += expert_copy_ahead_bytes(info, first)
    assert plan.devices is not None
    assert [d.draft_weights_bytes + d.draft_kv_cache_bytes + d.draft_compute_bytes
            for d in plan.devices] == drafted
    used = [u + dr for u, dr in zip(used, drafted)]
    assert [d.used_bytes for d in plan.devices] == used
    assert all(u <= b for u, b in zip(used, budgets)), (used, budgets)
    for d, dev in enumerate(plan.devices):
        assert dev.blocks == [b for b in range(info.n_layer) if devices[b] == d]
        assert dev.output == (devices[-1] == d) and dev.budget_bytes == budgets[d]
        assert dev.headroom_bytes == budgets[d] - used[d]
    for key in ("draft_weights_bytes", "draft_kv_cache_bytes", "draft_compute_bytes"):
        assert getattr(plan, key) == sum(getattr(d, key) for d in plan.devices)
    return devices


def test_two_budgets_without_profile(eight_blocks: Path) -> None:
    info, ctx = inspect_model(eight_blocks), 2048
    layer, base = info.layers[0].expert_bytes, fixed_per_gpu(info, ctx) + 8 * MIB
    for extra in [(0, 0), (layer, 0), (layer, 3 * layer), (3 * layer, layer), (5 * layer, 5 * layer), (0, 9 * layer)]:
        budgets = [base + extra[0], base + extra[1]]
        plan = plan_with(info, ctx, budgets)
        devices = check_within_budgets(plan, info, ctx, budgets)
        assert plan.vram_budget_bytes == sum(budgets) and plan.backend == "cuda"
        for d in (0, 1):  # stock placement on each GPU: its first layers whole, the rest in RAM
            mine = [n for layer, n in zip(info.layers, plan.slots_per_layer) if devices[layer.block] == d]
            assert mine == sorted(mine, reverse=True) and set(mine) <= {0, info.n_expert}
        assert "--moe-cache-slots" not in plan.server_args


def test_two_budgets_with_profile_fill_each_gpu(patched_build, eight_blocks: Path, tmp_path: Path) -> None:
    """With a profile the allocator runs per GPU, over that GPU's MoE layers with that GPU's room
    (its budget less what it holds besides experts, recounted from the tensors), its whole layers
    first. (On this small random model a slot saves less CPU time than its pass costs: whole
    layers, no partly resident ones, and some room may stay unused.)"""
    profile = make_profile(patched_build, eight_blocks, tmp_path / "m8.moeprof", n_predict=16)
    info, ctx = inspect_model(eight_blocks), 2048
    layer, base = info.layers[0].expert_bytes, fixed_per_gpu(info, ctx) + 8 * MIB
    for extra in [(layer // 3, layer // 2), (2 * layer + layer // 4, layer // 5), (layer // 8, 4 * layer)]:
        budgets = [base + extra[0], base + extra[1]]
        plan = plan_with(info, ctx, budgets, profile)
        devices = check_within_budgets(plan, info, ctx, budgets)
        assert plan.devices is not None
        costs = layer_costs_of(info, read_profile(profile))
        for d, dev in enumerate(plan.devices):
            mine = [lay for lay in info.layers if devices[lay.block] == d]
            slots = [n for lay, n in zip(info.layers, plan.slots_per_layer) if lay in mine]
            room = budgets[d] - dev.used_bytes + sum(n * lay.bytes_per_expert for n, lay in zip(slots, mine))
            assert slots == allocate([costs[info.layers.index(lay)] for lay in mine], room)
            whole = [n >= info.n_expert for n in slots]
            assert whole == sorted(whole, reverse=True)  # the whole layers lead
        assert plan.whole_layers >= 1 and plan.profile == str(profile)


def test_one_budget_plans_as_before(fixture_models) -> None:
    """A single budget, or a list of one, is the one-GPU plan: no split flags, no devices key."""
    info = inspect_model(fixture_models["qwen3moe"])
    one, listed = plan_with(info, 2048, 1 << 30), plan_with(info, 2048, [1 << 30])
    assert one.to_json() == listed.to_json()
    doc = one.to_json()
    assert "devices" not in doc and "tensor_split" not in doc
    assert "--tensor-split" not in one.server_args and "-sm" not in one.server_args
    assert Plan.from_json(doc).budget == 1 << 30


def test_stored_plans_load(eight_blocks: Path) -> None:
    """An older record (no devices) loads as a one-GPU plan; a two-GPU plan round-trips with its budgets."""
    info = inspect_model(eight_blocks)
    old = plan_with(info, 2048, 1 << 30).to_json()
    assert Plan.from_json(old).devices is None and Plan.from_json(old).budget == 1 << 30
    two = plan_with(info, 2048, [1 << 30, 900 * MIB])
    again = Plan.from_json(json.loads(json.dumps(two.to_json())))
    assert again == two and again.budget == [1 << 30, 900 * MIB]


def test_budgets_that_no_split_holds(eight_blocks: Path) -> None:
    info = inspect_model(eight_blocks)
    with pytest.raises(MoeplugError, match="however the layers are split"):
        plan_with(info, 2048, [fixed_per_gpu(info, 2048) - MIB, 4 << 30])


def test_cli_plan_two_budgets(eight_blocks: Path) -> None:
    r = run_cli("plan", str(eight_blocks), "--vram-budget", "860MiB,900MiB", "--ctx", "2048", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [d["device"] for d in doc["devices"]] == ["CUDA0", "CUDA1"]
    for d in doc["devices"]:
        assert {"blocks", "moe_layers", "whole_layers", "slots", "expert_vram_bytes", "budget_bytes",
                "headroom_bytes", "used_bytes"} <= set(d) and d["headroom_bytes"] >= 0
    assert doc["vram_budget_bytes"] == 1760 * MIB
    args = doc["server_args"]
    assert args[args.index("--tensor-split") + 1] == ",".join(map(str, doc["tensor_split"]))
    text = run_cli("plan", str(eight_blocks), "--vram-budget", "860MiB,900MiB", "--ctx", "2048")
    assert text.returncode == 0 and "CUDA0" in text.stdout and "CUDA1" in text.stdout
    assert f"--tensor-split {','.join(map(str, doc['tensor_split']))}" in text.stdout


# ---------------------------------------------------------------------------------------------
# speculative decoding with two GPUs


@pytest.fixture(scope="module")
def draft5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 5-block draft with the fixture models' vocab: enough blocks for the split to share them."""
    spec = replace(fixture_spec("qwen3moe"), layers=5, experts=4, used=1, seed=11)
    return make_model(spec, tmp_path_factory.mktemp("draft5") / "draft5.gguf")[0]


def test_two_budgets_with_a_draft_model(eight_blocks: Path, draft5: Path) -> None:
    """The draft's blocks go to the GPUs by the plan's own --tensor-split over the draft's layers,
    each GPU's share of its weights and KV cache and a draft compute buffer off that GPU's budget."""
    info, draft, ctx = inspect_model(eight_blocks), inspect_model(draft5), 2048
    spec = Speculation("draft", str(draft5))
    layer, base = info.layers[0].expert_bytes, fixed_per_gpu(info, ctx) + 8 * MIB
    room = draft.total_bytes + kv_cache_bytes(draft, ctx) + draft_compute_bytes(draft)
    shared = 0
    for extra in [(room, room), (room + 3 * layer, room), (room // 2, room + room // 2), (0, 2 * room + 5 * layer)]:
        budgets = [base + extra[0], base + extra[1]]
        plan = plan_with(info, ctx, budgets, spec=spec)
        check_within_budgets(plan, info, ctx, budgets, draft=draft)
        assert plan.draft_weights_bytes == draft.total_bytes  # every tensor of the draft on a GPU (-ngld 99)
        assert plan.tokens_per_step == 4 and plan.server_args[-6:-4] == ["-ngld", "99"]
        shared += all(d.draft_weights_bytes for d in plan.devices or [])
    assert shared  # at least one plan shares the draft over both GPUs
    with pytest.raises(MoeplugError, match="and the draft's share however the layers are split.*without --spec"):
        plan_with(info, ctx, [base, base], spec=spec)
    plan_with(info, ctx, [base, base])  # the same budgets hold the model without the draft


def test_two_budgets_with_an_mtp_head(fixture_models) -> None:
    """--mtp: the NextN block (the model's last) is the draft's, whole, on the GPU the split gives
    it, with its KV cache and a draft compute buffer; without it, that layer gets no slot."""
    info, ctx = inspect_model(fixture_models["hy_v3-mtp"]), 1024
    assert nextn_layers(info) == 1
    base = fixed_per_gpu(info, ctx) + info.total_bytes + kv_cache_bytes(info, ctx) + \
        kv_cache_bytes(info, ctx, mtp=True) + draft_compute_bytes(info)
    for budgets in ([base, base], [fixed_per_gpu(info, ctx) + info.total_bytes // 4, base]):
        plan = plan_with(info, ctx, budgets, spec=Speculation("mtp"))
        devices = check_within_budgets(plan, info, ctx, budgets, mtp=True)
        assert plan.server_args[-4:] == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
        holder = devices[info.n_layer - 1]
        assert plan.devices is not None and plan.devices[1 - holder].draft_weights_bytes == 0
        plain = plan_with(info, ctx, budgets)
        check_within_budgets(plain, info, ctx, budgets)
        assert plain.slots_per_layer[-1] == 0 and plain.draft_weights_bytes == 0


def test_cli_plan_two_budgets_with_a_draft(eight_blocks: Path, draft5: Path) -> None:
    r = run_cli("plan", str(eight_blocks), "--vram-budget", "3GiB,3GiB", "--ctx", "2048", "--draft", str(draft5),
                "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["speculation"]["kind"] == "draft" and "--tensor-split" in doc["server_args"]
    assert doc["draft_weights_bytes"] == sum(d["draft_weights_bytes"] for d in doc["devices"]) > 0
    text = run_cli("plan", str(eight_blocks), "--vram-budget", "3GiB,3GiB", "--ctx", "2048", "--draft", str(draft5))
    assert text.returncode == 0 and "draft" in text.stdout.split("layer split:")[0].split("CUDA0")[0]


# ---------------------------------------------------------------------------------------------
# llama.cpp's own layer assignment, on two RPC devices backed by the CPU


# rpc_devices: the session fixture in conftest.py (two rpc-server processes backed by the CPU)


def fit_params(patched_build, rpc_devices, model: Path, extra: list[str]) -> subprocess.CompletedProcess:
    import os

    r = subprocess.run([str(patched_build.binary("llama-fit-params")), *rpc_devices["args"], "-m", str(model),
                        *extra], capture_output=True, text=True, timeout=120, env=os.environ | rpc_devices["env"])
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def llama_assignment(patched_build, rpc_devices, model: Path, extra: list[str]) -> list[int | None]:
    """llama.cpp's device per layer (the output layer last) for these flags, from its debug log."""
    r = fit_params(patched_build, rpc_devices, model, ["-c", "512", "-fit", "off", "-v", *extra])
    found = re.findall(r"layer\s+(\d+) assigned to device (\S+?),", r.stdout + r.stderr)
    assert found, (r.stdout + r.stderr)[-2000:]
    names = {"RPC0": 0, "RPC1": 1, "CPU": None}
    return [names[dev] for _, dev in sorted(found, key=lambda x: int(x[0]))]


@pytest.mark.native
def test_split_matches_llama_cpp_on_two_rpc_devices(patched_build, rpc_devices, tmp_path: Path) -> None:
    model = make_model(replace(fixture_spec("qwen3moe", dtype="f16"), layers=47, embd=64, expert_ff=64, head_dim=16),
                       tmp_path / "m47.gguf")[0]
    cases = [("1,1", "99"), ("3,1", "99"), ("0.4,0.6", "99"), ("0.7,0.9", "99"), ("1,1", "47"), ("1,0", "99"),
             ("5,43", "99")]
    for ts, ngl in cases:
        got = llama_assignment(patched_build, rpc_devices, model, ["-ngl", ngl, "-sm", "layer", "-ts", ts])
        assert got == layer_devices(47, [float(x) for x in ts.split(",")], int(ngl)), (ts, ngl)


@pytest.mark.native
def test_planned_split_is_the_one_llama_cpp_loads(patched_build, rpc_devices, eight_blocks: Path) -> None:
    """The plan's flags put its blocks and output layer where it says; and llama.cpp's own estimate
    of each device's buffers for them (llama-fit-params --fit-print, every routed expert in RAM:
    weights, context, compute in whole MiB) is the KV cache the plan counts per GPU, and at most
    the weights and compute buffer it counts (it counts the token embeddings, which stay in RAM,
    on the output layer's GPU, and a compute buffer on the high side)."""
    from moeplug.planner.fit_estimate import parse_fit_print

    info = inspect_model(eight_blocks)
    splits = set()
    for budgets in ([845 * MIB, 846 * MIB], [846 * MIB, 844 * MIB], [900 * MIB, 845 * MIB]):
        plan = plan_with(info, 2048, budgets)
        splits.add(tuple(plan.tensor_split or ()))
        args = plan.server_args
        flags = args[args.index("-ngl"): args.index("--tensor-split") + 2]
        got = llama_assignment(patched_build, rpc_devices, eight_blocks, flags)
        assert plan.devices is not None
        assert [[b for b in range(info.n_layer) if got[b] == d] for d in (0, 1)] == \
            [dev.blocks for dev in plan.devices]
        assert [got[-1] == d for d in (0, 1)] == [dev.output for dev in plan.devices]
        r = fit_params(patched_build, rpc_devices, eight_blocks, ["-c", "2048", *flags, "--cpu-moe", "--fit-print", "on"])
        needs = parse_fit_print(r.stdout)
        assert [n.device for n in needs] == ["RPC0", "RPC1"], r.stdout
        for need, dev in zip(needs, plan.devices):
            assert need.context == dev.kv_cache_bytes
            assert need.model <= dev.non_expert_bytes + MIB and need.compute <= dev.compute_bytes
    assert len(splits) == 3 and (9, 0) in splits  # two ways of sharing the blocks, and all on GPU 0


@pytest.mark.native
@pytest.mark.parametrize("kind", ["draft", "mtp"])
def test_draft_follows_the_planned_split_on_two_rpc_devices(patched_build, rpc_devices, eight_blocks: Path,
                                                            draft5: Path, fixture_models, tmp_path: Path,
                                                            kind: str) -> None:
    """llama-server with the plan's flags and speculation on two devices: a draft model's blocks
    land where the plan put its share (the target's --tensor-split over the draft's own layers), and
    the draft's KV cache on each device, a draft model's or the MTP head's, is what the plan counts
    there (its weights and compute buffer at most that)."""
    from moeplug.serving.server import start_server
    from moeplug.serving.launch import parse_buffers

    model = eight_blocks if kind == "draft" else fixture_models["hy_v3-mtp"]
    info = inspect_model(model)
    spec = Speculation("draft", str(draft5)) if kind == "draft" else Speculation("mtp")
    plan = plan_with(info, 512, [3 << 30, 3 << 30], spec=spec)
    assert plan.devices is not None and all(d.blocks for d in plan.devices)
    log_path = tmp_path / "srv.log"
    with start_server(patched_build.binary("llama-server"), model, log_path, ctx=None, threads=2,
                      env=rpc_devices["env"],
                      extra_args=[*rpc_devices["args"], "-np", "1", "-v", *plan.server_args]) as srv:
        srv.wait_healthy()
    log = log_path.read_text()
    marker = f"loading draft model '{draft5}'" if kind == "draft" else "creating MTP draft context"
    assert marker in log, log[-3000:]
    section = log[log.index(marker):]
    if kind == "draft":
        found = re.findall(r"layer\s+(\d+) assigned to device (\S+?),", section)
        names = {"RPC0": 0, "RPC1": 1, "CPU": None}
        got = [names[dev] for _, dev in sorted(found, key=lambda x: int(x[0]))]
        assert got == layer_devices(inspect_model(draft5).n_layer, plan.tensor_split or [], 99)
        assert set(got) == {0, 1}
    buffers = parse_buffers(section.split("adding speculative implementation")[0])
    endpoints = rpc_devices["args"][rpc_devices["args"].index("--rpc") + 1].split(",")  # RPC0, RPC1 in this order
    for endpoint, dev in zip(endpoints, plan.devices):  # buffers are named RPC0[HOST:PORT] on every RPC device
        name = f"RPC0[{endpoint}]"
        assert buffers["KV"].get(name, 0) * MIB == pytest.approx(dev.draft_kv_cache_bytes, abs=0.01 * MIB)
        assert buffers.get("model", {}).get(name, 0) * MIB <= dev.draft_weights_bytes + 0.01 * MIB  # MTP: none
        assert buffers.get("compute", {}).get(name, 0) * MIB <= dev.draft_compute_bytes
