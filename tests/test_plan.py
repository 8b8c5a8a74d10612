"""The slot planner: its arithmetic against what a real llama-server allocates, and its warnings."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from helpers import layer_costs_of, make_profile, plan_with, run_cli, run_cli_process, xdg_homes
from moeplug.planner.allocate import (LayerCost, _curve, _layer_counts, allocate, hit_curves, modelled_seconds, prefill_uploads,
                              served_share, slot_order, stream_share,
                              uniform_hits)
from moeplug.core.errors import MoeplugError
from moeplug.model.inspect import inspect_model
from moeplug.planner.estimates import (cache_compute_extra, compute_buffer_bytes, ubatch_growth_bytes, expert_copy_ahead_bytes, kv_cache_bytes, logits_bytes, stock_ncmoe, vocab_size)
from moeplug.planner.record import Plan
from moeplug.planner.server_flags import experts_in_ram_args, placement_args
from moeplug.core.sizes import GIB, parse_size
from moeplug.profile.format import PHASE_DECODE, PHASE_PREFILL, Profile, ProfileSource, read_profile
from moeplug.serving.launch import parse_buffers
from moeplug.serving.server import start_server
from moeplug.planner.costs import DEFAULT_COSTS

MIB = 1 << 20
PROMPTS = Path(__file__).parents[1] / "profiles" / "codeish.txt"


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in a server's arguments (None: not there)."""
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("text,value", [("12GiB", 12 << 30), ("12G", 12 << 30), ("8000MiB", 8000 << 20),
                                        ("1.5 GiB", int(1.5 * (1 << 30))), ("4096", 4096)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_rejects_nonsense() -> None:
    with pytest.raises(MoeplugError, match="is not a size"):
        parse_size("twelve gigs")


def fixed_bytes(info, ctx: int) -> int:
    return info.non_expert_bytes + kv_cache_bytes(info, ctx) + compute_buffer_bytes(info) + DEFAULT_COSTS.cuda_pool_headroom + \
        DEFAULT_COSTS.safety_margin


def experts_in_ram(args: list[str], info) -> list[str]:
    """The expert tensors that the plan's -ot puts in RAM (llama.cpp matches with regex_search)."""
    if "-ot" not in args:
        return []
    pattern = re.compile(args[args.index("-ot") + 1].rsplit("=", 1)[0])
    return sorted(f"blk.{layer.block}.{name}" for layer in info.layers for name in layer.tensors
                  if pattern.search(f"blk.{layer.block}.{name}"))


def expert_tensors(info, blocks: list[int]) -> list[str]:
    return sorted(f"blk.{layer.block}.{name}" for layer in info.layers for name in layer.tensors
                  if layer.block in blocks)


@pytest.mark.parametrize("arch", ["qwen3moe", "hy_v3", "gpt-oss"])
def test_plan_without_profile_is_stock_placement(fixture_models, arch: str) -> None:
    """No profile to choose slots: stock's bytes, as many whole layers as -ncmoe gives, but the
    last layers' experts in RAM (stock --fit's choice, faster in prefill), and no cache."""
    info = inspect_model(fixture_models[arch])
    layer = info.layers[0].expert_bytes
    plan = plan_with(info, 2048, fixed_bytes(info, 2048) + layer + layer // 2)
    assert plan.whole_layers == 1 and plan.slots_per_layer[0] == sum(plan.slots_per_layer) == info.n_expert
    assert plan.stock_ncmoe == info.layers[-1].block
    args = plan.server_args
    assert experts_in_ram(args, info) == expert_tensors(info, [b.block for b in info.layers[1:]])
    assert "--moe-cache-slots" not in args and "--cpu-moe" not in args and "-ncmoe" not in args
    full = plan_with(info, 2048, fixed_bytes(info, 2048) + 100 * layer)
    assert full.slots_per_layer == [info.n_expert] * len(info.layers)
    assert not {"--cpu-moe", "-ot", "--moe-cache-slots"} & set(full.server_args)


def test_plan_with_profile_spends_the_budget_on_slots(patched_build, fixture_models, tmp_path: Path) -> None:
    """With a real profile the slots fit the budget; whole layers load onto the GPU as stock's do,
    the other layers' experts stay in RAM."""
    model = fixture_models["qwen3moe"]
    profile = tmp_path / "p.gguf"
    r = subprocess.run([str(patched_build.binary("llama-moe-profile")), "-m", str(model), "--prompts",
                        str(PROMPTS), "--out", str(profile), "-n", "16", "-t", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    info = inspect_model(model)
    layer = info.layers[0].expert_bytes
    for k in (1.5, 2.5):
        room = int(k * layer)
        plan = plan_with(info, 2048, fixed_bytes(info, 2048) + room, profile)
        # tiny experts: the CPU round trip outweighs any partial layer, whole layers win
        assert plan.whole_layers == int(k) and plan.expert_vram_bytes <= room
        ram = [b.block for b, n in zip(info.layers, plan.slots_per_layer) if n < info.n_expert]
        assert experts_in_ram(plan.server_args, info) == expert_tensors(info, ram)
        assert "--moe-cache-slots" not in plan.server_args  # no partly resident layer: nothing for the cache
        assert plan.modelled_host_ms <= plan.stock_modelled_host_ms
        assert any(n.startswith("stock's placement") and "no cache" in n for n in plan.notes), plan.notes


def big_expert_model(tmp_path: Path, arch: str = "gpt-oss") -> tuple[Path, Profile]:
    """Two MoE layers of 16 experts of 6 MiB (the fixtures' are 0.2 MiB: a CPU round trip outweighs
    any slot there) and a profile of a skewed router, four experts taking nearly all selections: a
    budget of 1.5 layers' experts is best spent on slots in both layers."""
    from moeplug.model.synth import ModelSpec, make_model

    path = make_model(ModelSpec(arch=arch, layers=2, experts=16, used=2, embd=512, expert_ff=2048, dtype="f16",
                                seed=5), tmp_path / f"{arch}-big-experts.gguf")[0]
    counts = np.array([[4000, 3000, 2000, 1000] + [5] * 12] * 2, dtype=np.int64)
    prof = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(2)],  # type: ignore[arg-type]
                   counts_prefill=counts * 0, counts_decode=counts, sources=[])
    return path, prof


def test_a_larger_ubatch_is_planned_with_its_compute_buffer(tmp_path: Path) -> None:
    """ubatch: the server's physical batch. Its compute buffer (a ubatch of logits, llama.cpp's estimate
    asked at the same -ub where there is one) comes off the slots' room; the server gets -b and -ub,
    the cache's max batch follows it, the plan keeps it, and an older record reads as llama.cpp's 512."""
    from moeplug.core.errors import MoeplugError
    from moeplug.planner.fit_estimate import DeviceNeed
    from moeplug.planner.record import Plan

    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    budget = fixed_bytes(info, 2048) + expert_copy_ahead_bytes(info) + info.expert_bytes // 2
    small, large = (plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, ubatch=u) for u in (512, 768))
    assert small.ubatch == 512 and large.ubatch == 768
    assert large.compute_bytes - small.compute_bytes == compute_buffer_bytes(info, 768) - compute_buffer_bytes(info)
    assert 0 < large.expert_vram_bytes < small.expert_vram_bytes and large.slots_total < small.slots_total
    for plan, batch in ((small, None), (large, "768")):
        args = plan.server_args
        assert ("-ub" in args) == (batch is not None)
        if batch:  # the logical batch stays llama.cpp's 2048 above a smaller one
            assert args[2:6] == ["-b", "2048", "-ub", batch]
        assert args[args.index("--moe-cache-max-batch") + 1] == (batch or "512")
    assert plan_with(info, 2048, 2 * GIB + budget, tmp_path / "p.gguf", profile=profile,
                     ubatch=4096).server_args[2:6] == ["-b", "4096", "-ub", "4096"]
    # beside llama.cpp's estimate (asked at its default ubatch), what the larger activations add (not
    # the larger ubatch of logits llama.cpp's estimate at that ubatch would count: the servers do not hold it)
    need = DeviceNeed("CUDA0", model=64 * MIB, context=8 * MIB, compute=96 * MIB)
    grown = ubatch_growth_bytes(info, 1024)
    room = need.total + DEFAULT_COSTS.cuda_context_reserve + grown + cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra) + \
        info.expert_bytes // 2
    measured = plan_with(info, 2048, room, tmp_path / "p.gguf", profile=profile, need=need, ubatch=1024)
    assert 0 < measured.expert_vram_bytes < info.expert_bytes
    assert grown == int(1.05 * 512 * 4 * 2 * 2 * (2048 + 512)) and ubatch_growth_bytes(info, 512) == 0
    assert measured.compute_bytes == 96 * MIB + grown + cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra)
    assert Plan.from_json(large.to_json()).ubatch == 768
    assert Plan.from_json({k: v for k, v in large.to_json().items() if k != "ubatch"}).ubatch == 512
    with pytest.raises(MoeplugError, match="--ubatch 16: at least 32"):
        plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, ubatch=16)
    # a draft model's context takes the server's batch sizes too: not planned for above 512
    from moeplug.planner.speculation import Speculation
    with pytest.raises(MoeplugError, match="--ubatch 1024 with --spec mtp: not planned yet"):
        plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, ubatch=1024, spec=Speculation("mtp"))
    assert plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, ubatch=1024,
                     spec=Speculation("ngram")).ubatch == 1024


def test_long_prompt_uploads_counts_each_batch_of_a_long_prompt() -> None:
    """A prompt of several batches uploads the experts without a slot once per batch: a batch of b
    tokens picks an expert of per-token probability p with chance 1 - (1 - p)^b."""
    from moeplug.planner.allocate import long_prompt_uploads

    hits = uniform_hits(8)  # 2 of 8 used: every expert p = 0.25
    per_token, batches = long_prompt_uploads(hits, 2, 1024, 512)
    assert batches == 2 / 1024
    assert per_token[0] == pytest.approx(2 * 8 / 1024) and per_token[8] == 0.0  # nearly every expert, twice
    assert per_token[6] == pytest.approx(2 * 2 / 1024)
    one_batch, _ = long_prompt_uploads(hits, 2, 1024, 1024)
    assert one_batch[0] == pytest.approx(per_token[0] / 2)  # one batch of 1024: each expert once
    short, batches = long_prompt_uploads(hits, 2, 3, 512)  # three tokens pick few
    assert batches == 1 / 3 and short[0] == pytest.approx(8 * (1 - 0.75 ** 3) / 3)
    partial, _ = long_prompt_uploads(hits, 2, 600, 512)  # a full batch and one of 88 tokens
    assert partial[0] == pytest.approx(8 * (2 - 0.75 ** 512 - 0.75 ** 88) / 600)


def test_ubatch_auto_weighs_larger_prompt_batches_for_long_prompts(tmp_path: Path) -> None:
    """--ubatch auto (the default): llama.cpp's 512 unless prompts longer than it are planned for
    (--prompt-tokens) with prompts weighed; then the candidate modelled fastest in all, decode with the
    slots its larger activations leave plus its prompt batches, a larger one only 5% faster than the
    smaller. What was weighed is in the notes; the asked ubatch and the prompt length stay with the
    plan, and an older record's ubatch other than 512 reads as asked."""
    from moeplug.planner.fit_estimate import DeviceNeed
    from moeplug.planner.plan import ubatch_candidates
    from moeplug.planner.request import UBATCH_AUTO, PlanRequest
    from moeplug.planner.speculation import Speculation

    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    need = DeviceNeed("CUDA0", model=64 * MIB, context=8 * MIB, compute=96 * MIB)
    room = need.total + DEFAULT_COSTS.cuda_context_reserve + cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra) + info.expert_bytes // 2

    def plan(**kw) -> Plan:
        return plan_with(info, 4096, room, tmp_path / "p.gguf", profile=profile, need=need, **kw)

    def total(p: Plan) -> float:
        return p.modelled_host_ms - p.modelled_stream_saving_ms

    short = plan()
    assert short.ubatch == 512 and short.ubatch_asked == UBATCH_AUTO and short.prompt_tokens is None
    assert "-ub" not in short.server_args and not any("prompt batches of" in n for n in short.notes)
    # the tiny model's uploads are small beside a decoded token's misses: only a heavy prompt weight pays
    for weight, chosen in ((1, 512), (1000, 2048)):
        auto = plan(prompt_tokens=4096, prefill_weight=weight)
        fixed = {u: plan(prompt_tokens=4096, prefill_weight=weight, ubatch=u) for u in (512, 1024, 2048)}
        assert auto.ubatch == chosen and auto.ubatch_asked == UBATCH_AUTO and auto.prompt_tokens == 4096
        assert auto.slots_per_layer == fixed[chosen].slots_per_layer and total(auto) == total(fixed[chosen])
        assert all(total(auto) <= total(p) for p in fixed.values())
        assert fixed[2048].modelled_prompt_us < fixed[1024].modelled_prompt_us < fixed[512].modelled_prompt_us
        assert fixed[2048].compute_bytes >= need.compute + ubatch_growth_bytes(info, 2048)  # off the slots' room
        note = next(n for n in auto.notes if "prompt batches of" in n)
        assert f"prompts of 4096 tokens at {weight:g} prompt tokens" in note and "2048: " in note
        assert ("chosen" in note) == (chosen > 512) and ("-ub" in auto.server_args) == (chosen > 512)
        assert all(p.ubatch_asked == p.ubatch for p in fixed.values())
    # nothing to gain: decode only, prompts that fit one batch, a draft model or MTP head, two GPUs, no GPU
    assert plan(prompt_tokens=4096, prefill_weight=0).ubatch == 512
    def candidates(budget, spec, prof, weight, prompt_tokens):
        return ubatch_candidates(PlanRequest(4096, budget, spec=spec, prefill_weight=weight,
                                             prompt_tokens=prompt_tokens), prof)

    assert candidates(room, None, profile, 1000, 300) == (512,)
    assert candidates(room, None, profile, 1000, 1000) == (512, 1024)
    assert candidates(room, Speculation("mtp"), profile, 1000, 4096) == (512,)
    assert candidates(room, Speculation("ngram"), profile, 1000, 4096) == (512, 1024, 2048)
    assert candidates([room, room], None, profile, 1000, 4096) == (512,)
    assert candidates(None, None, profile, 1000, 4096) == (512,)
    assert candidates(room, None, None, 1000, 4096) == (512,)
    assert plan(prompt_tokens=0).prompt_tokens is None  # 0: the profile's prompts
    with pytest.raises(MoeplugError, match="--prompt-tokens -1: 0 or more"):
        plan(prompt_tokens=-1)
    # records
    again = Plan.from_json(auto.to_json())
    assert (again.ubatch, again.ubatch_asked, again.prompt_tokens) == (2048, UBATCH_AUTO, 4096)
    old = {k: v for k, v in fixed[1024].to_json().items() if k not in ("ubatch_asked", "prompt_tokens")}
    assert Plan.from_json(old).ubatch_asked == 1024 and Plan.from_json(old | {"ubatch": 512}).ubatch_asked == UBATCH_AUTO
    # a budget that holds 512's buffers but not 2048's larger activations: the plan at what fits, not an error
    tight = (room - info.expert_bytes // 2 - cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra)
             + (ubatch_growth_bytes(info, 1024) + ubatch_growth_bytes(info, 2048)) // 2)
    with pytest.raises(MoeplugError, match="does not hold"):
        plan_with(info, 4096, tight, tmp_path / "p.gguf", profile=profile, need=need, ubatch=2048)
    fits = plan_with(info, 4096, tight, tmp_path / "p.gguf", profile=profile, need=need, prompt_tokens=4096,
                     prefill_weight=1000)
    assert fits.ubatch in (512, 1024)
    assert any("prompt batches of 2048 tokens or more were not weighed" in n for n in fits.notes)


def test_the_server_runs_on_half_the_cores_where_few_layers_are_partly_resident(tmp_path: Path) -> None:
    """Where a few partly resident layers (at most a quarter of the MoE layers) share each token between
    the GPU's slots and the CPU's misses, the plan runs the server on half the physical cores (8 or more;
    the H200 box's 16 took 8), last in its flags so that it wins; more partly resident layers (the CPU's
    share larger), fewer cores, no CPU pass (every expert in VRAM), no cache (no profile: stock's
    placement) or no GPU leave llama.cpp's default. Asked for, the user's count goes everywhere, 0
    meaning llama.cpp's default; both are kept in the plan's JSON."""
    from moeplug.model.synth import ModelSpec, make_model

    model = make_model(ModelSpec(arch="qwen3moe", layers=8, experts=16, used=2, embd=512, expert_ff=2048, dtype="f16",
                                 seed=5), tmp_path / "eight-layers.gguf")[0]
    counts = np.array([[4000, 3000, 2000, 1000] + [5] * 12] * 8, dtype=np.int64)
    profile = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(8)],  # type: ignore[arg-type]
                      counts_prefill=counts * 0, counts_decode=counts, sources=[])
    info = inspect_model(model)
    layer = info.expert_bytes // 8
    budget = fixed_bytes(info, 2048) + 7 * layer + layer // 2  # room for 7.5 layers' experts
    plan = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, cpu_cores=16)
    partial = sum(0 < n < info.n_expert for n in plan.slots_per_layer)
    assert 0 < partial <= DEFAULT_COSTS.server_threads_few_partial * 8 and "--moe-cache-slots" in plan.server_args
    assert plan.threads == 8 and plan.threads_asked is None and plan.server_args[-2:] == ["-t", "8"]
    assert any("half of the 16 physical cores it may use" in n for n in plan.notes)
    assert plan.to_json()["threads"] == 8
    spread = plan_with(info, 2048, fixed_bytes(info, 2048) + 4 * layer, tmp_path / "p.gguf", profile=profile,
                       cpu_cores=16)  # half the experts' bytes: spread over most layers
    assert sum(0 < n < info.n_expert for n in spread.slots_per_layer) > DEFAULT_COSTS.server_threads_few_partial * 8
    assert spread.threads is None and "-t" not in spread.server_args
    for cores in (None, 6, 7):
        few = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, cpu_cores=cores)
        assert few.threads is None and "-t" not in few.server_args
    assert plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, cpu_cores=9).threads == 4
    full = plan_with(info, 2048, fixed_bytes(info, 2048) + 2 * info.expert_bytes, tmp_path / "p.gguf", profile=profile,
                     cpu_cores=16)
    assert full.whole_layers == len(info.layers) and full.threads is None and "-t" not in full.server_args
    stock = plan_with(info, 2048, budget, cpu_cores=16)  # no profile: stock's placement, no cache
    assert stock.threads is None and "-t" not in stock.server_args
    asked = plan_with(info, 2048, fixed_bytes(info, 2048) + 4 * layer, tmp_path / "p.gguf", profile=profile, cpu_cores=16, threads=5)
    assert (asked.threads, asked.threads_asked, asked.server_args[-2:]) == (5, 5, ["-t", "5"])
    assert any("5 CPU threads (-t 5), as asked" in n for n in asked.notes)
    default = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, cpu_cores=16, threads=0)
    assert (default.threads, default.threads_asked) == (None, 0) and "-t" not in default.server_args
    cpu = plan_with(info, 2048, None, cpu_cores=16)  # no GPU
    assert cpu.threads is None and plan_with(info, 2048, None, threads=3).server_args[-2:] == ["-t", "3"]
    assert Plan.from_json({k: v for k, v in plan.to_json().items() if not k.startswith("threads")}).threads is None


def test_physical_cores_counts_hyperthread_siblings_once() -> None:
    """The cores the planner halves: those this process may run on, siblings once (as llama.cpp's
    default thread count counts them), at least one and no more than the CPUs."""
    import os

    from moeplug.machine.probes import physical_cores

    cores = physical_cores()
    assert cores is not None and 1 <= cores <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("files,cores", [({"cpu.max": "400000 100000\n"}, 4), ({"cpu.max": "150000 100000\n"}, 2),
                                         ({"cpu.max": "max 100000\n"}, None), ({}, None),
                                         ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),
                                         ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None)])
def test_a_cpu_quota_caps_the_cores(tmp_path: Path, files: dict[str, str], cores: int | None) -> None:
    """A container's CPU quota (cgroup v2 cpu.max, v1 cfs quota/period) counts as that many cores,
    rounded up; none, or unlimited, leaves the physical cores."""
    from moeplug.machine.probes import cpu_quota_cores

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota_cores(tmp_path) == cores


def test_the_copy_ahead_is_counted_where_experts_stay_in_ram(fixture_models, tmp_path: Path) -> None:
    """With the cache on and experts in RAM a prompt batch's gate and down weights are copied while the
    split before computes (patch 0021): the compute buffer holds a second expert weight, and the
    plan counts the largest one on top of either estimate (two where the experts have biases, as
    gpt-oss's do: the copy stays live across the bias add, patch 0021); with every expert in VRAM,
    without a profile, or where no layer is partly resident (no cache), none."""
    q3 = inspect_model(fixture_models["qwen3moe"])
    assert expert_copy_ahead_bytes(q3) == max(t.n_bytes for layer in q3.layers for t in layer.tensors.values())
    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    largest = 2 * max(t.n_bytes for layer in info.layers for name, t in layer.tensors.items()
                      if name.endswith("_exps.weight"))
    assert any(name.endswith("_exps.bias") for name in info.layers[0].tensors)
    assert expert_copy_ahead_bytes(info) == largest
    base = compute_buffer_bytes(info) + DEFAULT_COSTS.cuda_pool_headroom
    budget = fixed_bytes(info, 2048) + 3 * info.expert_bytes // 4
    plan = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile)
    assert all(0 < n < info.n_expert for n in plan.slots_per_layer), plan.slots_per_layer
    assert plan.compute_bytes == base + largest and plan.expert_vram_bytes <= 3 * info.expert_bytes // 4 - largest
    assert plan.stock_ncmoe == stock_ncmoe(info, 3 * info.expert_bytes // 4)  # stock holds no second copy
    assert plan_with(info, 2048, budget).compute_bytes == base
    # room for less than the copy: no slot, no cache, no copy; stock's placement (every expert on the CPU)
    tight = plan_with(info, 2048, fixed_bytes(info, 2048) + largest // 2, tmp_path / "p.gguf", profile=profile)
    assert sum(tight.slots_per_layer) == 0 and tight.compute_bytes == base
    full = plan_with(info, 2048, fixed_bytes(info, 2048) + 2 * info.expert_bytes, tmp_path / "p.gguf", profile=profile)
    assert full.compute_bytes == base
    # llama.cpp's own estimate (fit_estimate.gpu_need) is of stock's path, sized for a ubatch of logits:
    # the copies come on top of it as far as they outgrow those logits, never less than what the
    # benchmark shapes measured above it (their logits outweigh their copies; the fixture's do not)
    from moeplug.planner.fit_estimate import DeviceNeed
    need = DeviceNeed("CUDA0", model=64 * MIB, context=8 * MIB, compute=32 * MIB)
    with_need = plan_with(info, 2048, need.total + DEFAULT_COSTS.cuda_context_reserve + 3 * info.expert_bytes // 4,
                          tmp_path / "p.gguf", profile=profile, need=need)
    extra = cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra)
    assert extra == max(DEFAULT_COSTS.cache_compute_extra, largest // 2 + largest - logits_bytes(info))
    assert with_need.compute_bytes == 32 * MIB + extra and with_need.slots_total > 0
    # the fixture's experts are small beside the extra: it would take the room, so stock's placement
    fixture = inspect_model(fixture_models["gpt-oss"])
    small = plan_with(fixture, 2048, need.total + DEFAULT_COSTS.cuda_context_reserve + fixture.expert_bytes // 2,
                      tmp_path / "p.gguf", profile=replace(profile, tensors=[f"blk.{i}.ffn_down_exps.weight"
                                                                            for i in range(len(fixture.layers))],
                                                           counts_decode=np.ones((len(fixture.layers), 8), np.int64),
                                                           counts_prefill=np.zeros((len(fixture.layers), 8), np.int64)),
                      need=need)
    assert fixture.expert_bytes // 2 < DEFAULT_COSTS.cache_compute_extra
    assert small.compute_bytes == 32 * MIB and "--moe-cache-slots" not in small.server_args
    largest = expert_copy_ahead_bytes(fixture)
    assert vocab_size(fixture) == 515  # the fixture's: the token embeddings' rows
    assert cache_compute_extra(fixture, 0) == largest // 2 + largest - 4 * 512 * 515  # the copies outgrow its logits
    big_vocab = replace(fixture, tensors=[replace(t, shape=(t.shape[0], 200_000)) if t.name == "token_embd.weight"
                                          else t for t in fixture.tensors])
    assert cache_compute_extra(big_vocab, 0) == 0 and cache_compute_extra(big_vocab, 7) == 7


def test_a_plan_without_copies_ahead_gives_their_bytes_to_slots(tmp_path: Path) -> None:
    """copy_ahead=False: prompt batches copy one expert weight at a time, as stock's do, so the plan
    counts no second copy (own estimate) or llama.cpp's estimate less the logits the server never holds
    while it copies, plus one weight copy (llama.cpp's estimate); the bytes hold slots, and the server's
    environment turns the copies ahead off."""
    from moeplug.planner.estimates import cache_compute_single_copy
    from moeplug.planner.fit_estimate import DeviceNeed

    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    budget = fixed_bytes(info, 2048) + 3 * info.expert_bytes // 4
    on = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, copy_ahead=True)
    off = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile, copy_ahead=False)
    # both layers partly resident: the planner keeps the copies ahead
    assert plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile).to_json() == on.to_json()
    assert on.copy_ahead and not off.copy_ahead
    # the choice is the server's flag, never its environment (a proxy serving several models cannot hold that apart)
    assert on.server_env() == off.server_env() == {}
    assert "--moe-cache-copy-ahead" not in on.server_args and flag_value(off.server_args, "--moe-cache-copy-ahead") == "off"
    assert off.compute_bytes == on.compute_bytes - expert_copy_ahead_bytes(info)
    assert off.slots_total > on.slots_total and off.expert_vram_bytes > on.expert_vram_bytes
    assert off.stock_ncmoe == on.stock_ncmoe  # stock's placement is the same either way
    # llama.cpp's estimate: a ubatch of logits it counts and the server does not hold beside a weight copy
    largest = max(t.n_bytes for layer in info.layers for t in layer.tensors.values() if len(t.shape) == 3)
    single = cache_compute_single_copy(info, DEFAULT_COSTS.cache_compute_extra)
    assert single == min(largest + DEFAULT_COSTS.cache_compute_extra - logits_bytes(info), cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra))
    need = DeviceNeed("CUDA0", model=64 * MIB, context=8 * MIB, compute=32 * MIB)
    room = need.total + DEFAULT_COSTS.cuda_context_reserve + 3 * info.expert_bytes // 4
    with_need = [plan_with(info, 2048, room, tmp_path / "p.gguf", profile=profile, need=need, copy_ahead=c)
                 for c in (True, False)]
    assert [p.compute_bytes for p in with_need] == [32 * MIB + cache_compute_extra(info, DEFAULT_COSTS.cache_compute_extra),
                                                   32 * MIB + single]
    assert with_need[1].slots_total >= with_need[0].slots_total
    # Plan JSON keeps the choice; an older record without it reads as the copies ahead on
    from moeplug.planner.record import Plan
    assert Plan.from_json(off.to_json()).copy_ahead is False
    assert Plan.from_json({k: v for k, v in off.to_json().items() if k != "copy_ahead"}).copy_ahead is True


def test_the_planner_drops_the_copies_ahead_where_few_layers_are_partly_resident(tmp_path: Path) -> None:
    """With most layers whole and one partly resident (at most a quarter of them, plan.COPY_AHEAD_FEW_PARTIAL)
    the planner plans prompt batches without the copies ahead and gives their bytes to slots; with
    most layers partly resident it keeps them. The installed record's flags follow, its environment stays empty."""
    from moeplug.serving.installed import InstalledModel
    from moeplug.model.synth import ModelSpec, make_model

    path = make_model(ModelSpec(arch="qwen3moe", layers=8, experts=16, used=2, embd=512, expert_ff=2048, dtype="f16",
                                seed=5), tmp_path / "eight-layers.gguf")[0]
    info = inspect_model(path)
    counts = np.array([[4000, 3000, 2000, 1000] + [5] * 12] * 8, dtype=np.int64)
    prof = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(8)],  # type: ignore[arg-type]
                   counts_prefill=counts * 0, counts_decode=counts, sources=[])
    layer = info.expert_bytes // 8
    few = fixed_bytes(info, 2048) + 7 * layer + layer // 2  # room for 7.5 layers' experts
    auto = plan_with(info, 2048, few, tmp_path / "p.gguf", profile=prof)
    forced = plan_with(info, 2048, few, tmp_path / "p.gguf", profile=prof, copy_ahead=True)
    partial = sum(0 < n < info.n_expert for n in forced.slots_per_layer)
    assert 0 < partial <= DEFAULT_COSTS.copy_ahead_few_partial * 8
    assert not auto.copy_ahead and auto.slots_total > forced.slots_total
    assert auto.compute_bytes == forced.compute_bytes - expert_copy_ahead_bytes(info)
    assert any("prompt batches copy their expert weights one at a time" in n for n in auto.notes)
    from moeplug.commands.install import plan_text
    assert "--moe-cache-copy-ahead off" in plan_text(auto)
    assert "copied one at a time" in plan_text(auto) and "copied ahead" in plan_text(forced)
    assert "server environment" not in plan_text(auto) + plan_text(forced)
    record = InstalledModel(name="m", ref=str(path), path=str(path), profile=None, build_id="b", ctx=2048, plan=auto)
    assert record.server_env() == {} and flag_value(record.plan.server_args, "--moe-cache-copy-ahead") == "off"
    back = InstalledModel.from_json(json.loads(json.dumps(record.to_json())))
    assert back.plan.server_args == record.plan.server_args and back.server_env() == {}
    many = fixed_bytes(info, 2048) + 4 * layer  # half the experts' bytes: spread over most layers
    kept = plan_with(info, 2048, many, tmp_path / "p.gguf", profile=prof)
    assert sum(0 < n < info.n_expert for n in kept.slots_per_layer) > DEFAULT_COSTS.copy_ahead_few_partial * 8
    assert kept.copy_ahead and kept.server_env() == {}


def test_short_prompts_go_to_the_gpu_where_the_cache_holds_slots_there(tmp_path: Path) -> None:
    """A plan whose cache holds slots on one GPU sends prompt batches of DEFAULT_COSTS.short_prompt_offload tokens or more
    to the GPU (--moe-cache-offload-min-batch in its server's flags, for the cache's layers of that model
    alone, said in a note and kept in the installed record; no process-wide GGML_OP_OFFLOAD_MIN_BATCH); a
    plan without the cache (every expert in VRAM, no profile: stock's placement), without a GPU or on two
    leaves llama.cpp's threshold alone; a record of the planner's revision 2, which set the variable
    instead, is made again (install.up_to_date)."""
    from moeplug.planner.record import PLANNER_REVISION, Plan, outdated
    from moeplug.planner.server_flags import OFFLOAD_MIN_BATCH_FLAG

    model, profile = big_expert_model(tmp_path)
    info = inspect_model(model)
    cached = plan_with(info, 2048, fixed_bytes(info, 2048) + 3 * info.expert_bytes // 4, tmp_path / "p.gguf",
                       profile=profile)
    assert any(0 < n < info.n_expert for n in cached.slots_per_layer) and "--moe-cache-slots" in cached.server_args
    assert cached.offload_min_batch == DEFAULT_COSTS.short_prompt_offload < 32
    i = cached.server_args.index(OFFLOAD_MIN_BATCH_FLAG)
    assert cached.server_args[i + 1] == str(DEFAULT_COSTS.short_prompt_offload) and cached.server_env() == {}
    assert any(f"{OFFLOAD_MIN_BATCH_FLAG} {DEFAULT_COSTS.short_prompt_offload}" in n for n in cached.notes)
    again = Plan.from_json(json.loads(json.dumps(cached.to_json())))
    assert again.server_args == cached.server_args and again.offload_min_batch == DEFAULT_COSTS.short_prompt_offload
    assert not outdated(again) and outdated(Plan.from_json(cached.to_json() | {"planner": PLANNER_REVISION - 1}))
    whole = plan_with(info, 2048, fixed_bytes(info, 2048) + 2 * info.expert_bytes, tmp_path / "p.gguf",
                      profile=profile)
    stock = plan_with(info, 2048, fixed_bytes(info, 2048) + 3 * info.expert_bytes // 4, None)
    cpu = plan_with(info, 2048, None, tmp_path / "p.gguf", profile=profile)
    half = fixed_bytes(info, 2048) + 3 * info.expert_bytes // 8
    two = plan_with(info, 2048, [half, half], tmp_path / "p.gguf", profile=profile)  # unmeasured on two GPUs
    assert two.devices is not None and "--moe-cache-slots" in two.server_args
    for plan in (whole, stock, cpu, two):
        assert plan.offload_min_batch is None and OFFLOAD_MIN_BATCH_FLAG not in plan.server_args
        assert "GGML_OP_OFFLOAD_MIN_BATCH" not in plan.server_env()


def test_a_plan_without_copies_ahead_prices_its_uploads_at_stocks_rate(tmp_path: Path) -> None:
    """Without the copies ahead a prompt batch copies each expert weight when its split starts, as
    stock's do, so the plan's uploads are priced at stock's rate (allocate.STOCK_UPLOAD_BYTES_PER_S),
    the plan with them at the cache's (run `2026-12-03-prefill-16gib`: at the cache's rate the Qwen3 shape's
    16 GiB plan modelled 39 us per prompt token ahead of stock, runs measured -32 to +26)."""
    from moeplug.planner.allocate import modelled_prompt_seconds
    from moeplug.model.synth import ModelSpec, make_model

    path = make_model(ModelSpec(arch="qwen3moe", layers=8, experts=16, used=2, embd=512, expert_ff=2048, dtype="f16",
                                seed=5), tmp_path / "eight-layers.gguf")[0]
    info = inspect_model(path)
    rng = np.random.default_rng(0)
    hot = np.r_[np.full(4, 0.2), np.full(12, 0.2 / 12)]  # prompts: four hot experts, the rest spread
    steps, meta = [], []
    for prompt in range(8):
        for pos in range(64):
            steps.append([rng.choice(16, 2, replace=False, p=hot) for _ in range(8)])
            meta.append([prompt, pos, 0])
        for pos in range(64):  # decoded tokens: experts 0-3
            steps.append([rng.choice(4, 2, replace=False) for _ in range(8)])
            meta.append([prompt, 64 + pos, 1])
    seq, meta_arr = np.array(steps, dtype=np.int16), np.array(meta, dtype=np.int32)
    counts = np.stack([np.bincount(seq[:, i].ravel(), minlength=16) for i in range(8)])
    prof = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(8)],  # type: ignore[arg-type]
                   counts_prefill=counts * 0, counts_decode=counts,
                   sources=[ProfileSource("t", ["p"] * 8, seq, meta_arr)])
    budget = fixed_bytes(info, 2048) + int(7.6 * info.expert_bytes // 8)
    on, off = (plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=prof, copy_ahead=c) for c in (True, False))
    assert 0 < sum(0 < n < 16 for n in off.slots_per_layer) and off.slots_total > on.slots_total
    ahead, single = layer_costs_of(info, prof), layer_costs_of(info, prof, copy_ahead=False)
    assert on.modelled_prompt_us == pytest.approx(1e6 * modelled_prompt_seconds(ahead, on.slots_per_layer))
    assert off.modelled_prompt_us == pytest.approx(1e6 * modelled_prompt_seconds(single, off.slots_per_layer))
    assert off.modelled_prompt_us == pytest.approx(1e6 * modelled_prompt_seconds(ahead, off.slots_per_layer)
                                                   * DEFAULT_COSTS.upload_bytes_per_s / DEFAULT_COSTS.stock_upload_bytes_per_s)
    # stock's placement is priced on stock's path either way
    assert off.stock_modelled_prompt_us == pytest.approx(on.stock_modelled_prompt_us)
    # the planner's choice still follows the count of partly resident layers (DEFAULT_COSTS.copy_ahead_few_partial)
    assert plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=prof).to_json()["slots_per_layer"] == \
        off.slots_per_layer


def flat_wide_model(tmp_path: Path) -> tuple[Path, Profile]:
    """Two MoE layers of 16 experts of 6 MiB, 8 picked per token, and a flat router: a partly resident
    layer misses several large experts per token, as gpt-oss-20b's do at a quarter of its experts."""
    from moeplug.model.synth import ModelSpec, make_model

    path = make_model(ModelSpec(arch="gpt-oss", layers=2, experts=16, used=8, embd=512, expert_ff=2048, dtype="f16",
                                seed=5), tmp_path / "gpt-oss-flat-wide.gguf")[0]
    counts = np.full((2, 16), 1000, dtype=np.int64)
    prof = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(2)],  # type: ignore[arg-type]
                   counts_prefill=counts * 0, counts_decode=counts, sources=[])
    return path, prof


def test_the_gpu_computes_part_of_the_misses_where_that_is_modelled_to_pay(tmp_path: Path) -> None:
    """With pinned weights on one GPU, a plan whose partly resident layers miss many large experts per
    token has the GPU compute the hottest share of them beside the CPU (--moe-cache-stream, the share
    allocate.stream_share picks), and counts the biases that pass reads in VRAM; with few misses (a
    skewed router's slots), with mmap, or without a partly resident layer, no stream."""
    from moeplug.planner.estimates import expert_side_bytes
    from moeplug.commands.install import plan_text
    from moeplug.core.sizes import GIB

    model, profile = flat_wide_model(tmp_path)
    info = inspect_model(model)
    args = dict(profile=profile, ram_available=64 * GIB)
    budget = fixed_bytes(info, 2048) + 9 * info.expert_bytes // 10
    streamed = plan_with(info, 2048, budget, tmp_path / "p.gguf", **args)
    assert any(0 < n < info.n_expert for n in streamed.slots_per_layer), streamed.slots_per_layer
    share, saving = stream_share(layer_costs_of(info, profile), streamed.slots_per_layer)
    assert share > 0 and (streamed.stream_share, streamed.modelled_stream_saving_ms) == (share, 1e3 * saving)
    flags = streamed.server_args
    assert flags[flags.index("--moe-cache-stream") + 1] == f"{share:g}"
    assert any(f"--moe-cache-stream {share:g}" in n and "less host time per token" in n for n in streamed.notes)
    side = expert_side_bytes(info.layers)
    assert side > 0 and any(name.endswith("_exps.bias") for name in info.layers[0].tensors)
    assert streamed.compute_bytes == compute_buffer_bytes(info) + DEFAULT_COSTS.cuda_pool_headroom + expert_copy_ahead_bytes(info) + side
    assert json.loads(json.dumps(streamed.to_json()))["stream_share"] == share
    row = next(line for line in plan_text(streamed).splitlines() if "misses the GPU computes" in line)
    assert f"{share:.0%} of the selections" in row and f"{1e3 * saving:.2f} ms less host time per token" in row
    mmap = plan_with(info, 2048, budget, tmp_path / "p.gguf", profile=profile)
    assert mmap.load_mode == "mmap" and "--moe-cache-stream" not in mmap.server_args and mmap.stream_share == 0
    whole = plan_with(info, 2048, fixed_bytes(info, 2048) + 2 * info.expert_bytes, tmp_path / "p.gguf", **args)
    assert "--moe-cache-stream" not in whole.server_args
    skewed_model, skewed = big_expert_model(tmp_path)
    few = plan_with(inspect_model(skewed_model), 2048, fixed_bytes(inspect_model(skewed_model), 2048)
                    + 3 * inspect_model(skewed_model).expert_bytes // 4, tmp_path / "p.gguf", profile=skewed,
                    ram_available=64 * GIB)
    assert any(0 < n < 16 for n in few.slots_per_layer) and "--moe-cache-stream" not in few.server_args


def test_stream_share_follows_the_measured_gpt_oss_plans() -> None:
    """The streaming model against what it was fitted to (`native/bench/results/2026-12-02-stream-share/`): the
    gpt-oss-20b shape's plan at 25% of its experts streamed 0.75 of its misses fastest (0, 0.75, 1
    measured, 4-10 slots of 32), at 50% (8-20) streaming lost; with verification batches of 4 at 25%,
    0.75 beat 0.5 and 1, and streaming beat none."""
    from moeplug.planner.allocate import stream_saving

    ranks = np.arange(33)
    curve = (1 - 0.92 ** ranks) / (1 - 0.92 ** 32)  # 52% of selections on 8 slots, 79% on 16: as those plans
    expert = 13_253_760  # one gpt-oss-20b expert's MXFP4 weights
    for k, slots, chosen in ((1, 8, 0.75), (1, 16, 0.0), (4, 8, 0.75)):
        costs = [LayerCost(expert, 32, 4, curve, k)] * 24
        share, saving = stream_share(costs, [slots] * 24)
        assert share == chosen, (k, slots, share)
        if chosen:
            assert saving == max(stream_saving(costs, [slots] * 24, s) for s in (0.25, 0.5, 0.75, 1.0)) > 0
    # Qwen3-30B-A3B's shape (48 layers of 128 small experts, 8 picked), not measured streaming: at a
    # quarter or half of its experts a token misses too few bytes per layer for the extra pass
    qwen3 = (1 - 0.983 ** np.arange(129)) / (1 - 0.983 ** 128)
    for slots in (32, 64):
        assert stream_share([LayerCost(2_654_208, 128, 8, qwen3)] * 48, [slots] * 48) == (0.0, 0.0)


def test_placement_args_give_the_cache_only_partly_resident_layers(fixture_models, tmp_path: Path) -> None:
    """Whole layers get no slots (they load onto the GPU), partly resident and RAM layers keep their
    experts in RAM, and the slot counts follow the profile's layer order."""
    info = inspect_model(fixture_models["qwen3moe"])
    n = info.n_expert
    blocks = [layer.block for layer in info.layers]
    tensors = [f"blk.{b}.ffn_down_exps.weight" for b in reversed(blocks)]  # a profile listing layers backwards
    prof = Profile(fingerprint=None, tensors=tensors, counts_prefill=np.zeros((3, n), np.int64),  # type: ignore[arg-type]
                   counts_decode=np.zeros((3, n), np.int64), sources=[])
    args = placement_args(info, [n, 3, 0], prof, tmp_path / "p.gguf")
    assert experts_in_ram(args, info) == expert_tensors(info, blocks[1:])
    assert args[args.index("--moe-cache-slots") + 1] == "0,3,0"
    assert args[args.index("--moe-cache-profile") + 1] == str(tmp_path / "p.gguf")
    assert placement_args(info, [n, n, 0], prof, tmp_path / "p.gguf") == experts_in_ram_args([blocks[2]])
    args = placement_args(info, [n, 5, 2], prof, tmp_path / "p.gguf")
    assert args[args.index("--moe-cache-slots") + 1] == "2,5,0"
    assert args[args.index("--moe-cache-max-batch") + 1] == "512"  # every batch of llama-server's ubatch


def cost(hits: np.ndarray, bytes_per_expert: int = 2_654_208, used: int = 8) -> LayerCost:
    return LayerCost(bytes_per_expert, len(hits) - 1, used, hits)


def whole_layers_lead(slots: Sequence[int], n_expert: int) -> bool:
    """No whole layer after a partly resident one."""
    return all(a >= n_expert or b < n_expert for a, b in itertools.pairwise(slots))


def test_allocation_is_optimal_against_brute_force() -> None:
    """Every way to spread the slots over four small layers, the whole ones first: the dynamic
    programme finds the least modelled time, prompt batches weighed or not."""
    rng = np.random.default_rng(5)
    for trial in range(40):
        layers = []
        for _ in range(4):
            p = np.sort(rng.dirichlet(np.full(6, rng.uniform(0.2, 3))))[::-1]
            layers.append(cost(np.concatenate([[0.0], np.cumsum(p)]), used=2))
            if trial % 2:  # with prompt batches: uploads per prompt token falling with the slots
                uploads = np.concatenate([np.sort(rng.uniform(0, 0.2, 6))[::-1], [0.0]])
                layers[-1] = LayerCost(2_654_208, 6, 2, layers[-1].hits, prefill=uploads,
                                       prefill_batches=1 / 64, prefill_weight=float(rng.uniform(0, 4)))
        room = int(rng.integers(0, 25)) * 2_654_208
        got = allocate(layers, room)
        assert sum(got) * 2_654_208 <= room and whole_layers_lead(got, 6)
        best = min(modelled_seconds(layers, list(c)) for c in itertools.product(range(7), repeat=4)
                   if sum(c) * 2_654_208 <= room and whole_layers_lead(c, 6))
        assert modelled_seconds(layers, got) == pytest.approx(best), (trial, got)


def test_partly_resident_layers_follow_the_whole_ones() -> None:
    """Room for 45 whole layers and 42 slots, two mid-model layers more skewed than the rest: the
    slots go after the whole layers (where stock --fit keeps its layers in RAM), not to those two."""
    layers = [cost(uniform_hits(128)) for _ in range(48)]
    zipf = 1 / np.arange(1, 129) ** 0.6
    layers[4] = layers[30] = cost(np.concatenate([[0.0], np.cumsum(zipf / zipf.sum())]))
    slots = allocate(layers, (45 * 128 + 42) * 2_654_208)
    assert slots[:45] == [128] * 45 and sum(slots[45:]) == 42 and slots[45] > 0
    assert modelled_seconds(layers, slots) < modelled_seconds(layers, [128] * 45 + [0] * 3)


def test_uniform_router_gets_whole_layers_skewed_router_gets_spread() -> None:
    uniform = [cost(uniform_hits(128)) for _ in range(48)]
    slots = allocate(uniform, int(31.5 * 128) * 2_654_208)
    assert sum(n == 128 for n in slots) == 31 and sum(slots) <= int(31.5 * 128)
    assert sum(0 < n < 128 for n in slots) <= 1  # the rest in one layer, not spread
    zipf = 1 / np.arange(1, 129) ** 1.2
    skewed = [cost(np.concatenate([[0.0], np.cumsum(zipf / zipf.sum())])) for _ in range(48)]
    slots = allocate(skewed, 40 * 48 * 2_654_208)
    assert all(n > 0 for n in slots) and sum(0 < n < 128 for n in slots) >= 40 and sum(slots) <= 40 * 48


def test_hit_curves_do_not_trust_lucky_experts() -> None:
    """A short profile of a uniform router makes its top experts look hot; ranking on half of the
    tokens and scoring on the other half gives back a near-linear curve."""
    rng = np.random.default_rng(1)
    n_steps, n_layers, n_expert, k = 200, 4, 128, 8
    seq = np.stack([np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_layers)])
                    for _ in range(n_steps)]).astype(np.int16)
    counts = np.stack([np.bincount(seq[:, i].ravel(), minlength=n_expert) for i in range(n_layers)])
    prof = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(n_layers)],  # type: ignore[arg-type]
                   counts_prefill=counts * 0, counts_decode=counts,
                   sources=[ProfileSource("t", ["p"], seq, np.zeros((n_steps, 3), np.int32))])
    cv = hit_curves(prof, n_layers, n_expert)
    naive = hit_curves(replace(prof, sources=[]), n_layers, n_expert)
    assert naive[:, 32].mean() > 0.33  # top quarter looks like a third of the traffic
    assert abs(cv[:, 32].mean() - 0.25) < 0.03
    assert np.all(np.diff(cv, axis=1) >= 0) and np.all(cv[:, -1] == 1.0)



def test_prompt_batches_upload_the_distinct_experts_behind_the_slots() -> None:
    """Two prompts, one layer of 8 experts, 2 picked per token: each prompt's batches count the
    distinct experts they pick behind the top N of the other prompt's ranking, per prompt token;
    a longer prompt than the ubatch uploads once per batch."""
    picks = {0: [(0, 1), (0, 2), (0, 1)], 1: [(0, 3), (1, 3)]}  # prompt 0 uses {0, 1, 2}, prompt 1 {0, 1, 3}
    seq = np.array([[ids] for q in (0, 1) for ids in picks[q]], dtype=np.int16)  # [5 tokens, 1 layer, 2]
    meta = np.array([[q, pos, 0] for q in (0, 1) for pos in range(len(picks[q]))], dtype=np.int32)
    counts = np.bincount(seq.ravel(), minlength=8)[None, :]
    prof = Profile(fingerprint=None, tensors=["blk.0.ffn_down_exps.weight"], counts_prefill=counts,  # type: ignore[arg-type]
                   counts_decode=counts * 0, sources=[ProfileSource("t", ["a", "b"], seq, meta)])
    # prompt 0 ranked by prompt 1's counts (3, 0, 1, 2, ...), prompt 1 by prompt 0's (0, 1, 2, 3, ...)
    uploads, batches = prefill_uploads(prof, 1, 8)
    assert uploads[0].tolist() == pytest.approx(np.array([6, 5, 3, 2, 0, 0, 0, 0, 0]) / 5)
    assert batches == pytest.approx(2 / 5)
    uploads, batches = prefill_uploads(prof, 1, 8, ubatch=2)  # prompt 0: {0, 1, 2} then {0, 1}
    assert uploads[0].tolist() == pytest.approx(np.array([8, 7, 4, 2, 0, 0, 0, 0, 0]) / 5)
    assert batches == pytest.approx(3 / 5)
    decode_only = replace(prof, sources=[ProfileSource("t", ["a", "b"], seq, meta * [1, 1, 0] + [0, 0, 1])])
    assert prefill_uploads(decode_only, 1, 8) is None  # no prompt tokens: no prompt cost


def test_a_prompt_heavy_workload_moves_slots_to_the_diverse_layer() -> None:
    """Two layers alike for decoding (skewed routers), room for one layer's experts. Decoding alone
    splits the slots evenly; when a prompt batch of 64 tokens picks 100 distinct experts in the
    first layer and 25 in the second, four prompt tokens per generated token move slots to the
    first, whose uploads they save."""
    zipf = 1 / np.arange(1, 129) ** 1.2
    hits = np.concatenate([[0.0], np.cumsum(zipf / zipf.sum())])
    n = np.arange(129)

    def layer(distinct: int, weight: float) -> LayerCost:
        return LayerCost(2_654_208, 128, 8, hits, prefill=distinct * (1 - n / 128) / 64, prefill_batches=1 / 64,
                         prefill_weight=weight)

    room = 128 * 2_654_208
    decode = allocate([layer(100, 0.0), layer(25, 0.0)], room)
    assert all(0 < s < 128 for s in decode) and abs(decode[0] - decode[1]) <= 1, decode
    prompts = allocate([layer(100, 4.0), layer(25, 4.0)], room)
    assert sum(prompts) == 128 and prompts[0] > decode[0] + 32, prompts
    assert modelled_seconds([layer(100, 4.0), layer(25, 4.0)], prompts) < \
        modelled_seconds([layer(100, 4.0), layer(25, 4.0)], decode)


def test_prompt_batches_stay_at_stock_s_cost() -> None:
    """48 skewed layers whose prompt batches of 64 tokens pick 40 distinct experts each. Where the
    slots (ranked on generated tokens) hold none of those, room for 44.3 layers' experts (stock
    keeps 45 whole with the copies' bytes too) spread over five layers would upload more per prompt
    than stock's three in RAM, though the cache's copies are faster: the plan keeps prompt batches
    at stock's modelled cost with fewer layers not whole, while planning for decode alone spreads.
    Where the slots hold them, the slots spread with room for 20 layers and prompt batches are
    faster than stock's. And where stock's placement is modelled no slower (a flat router, small
    experts), it is the plan."""
    from moeplug.planner.allocate import allocate_against_stock, modelled_prompt_seconds

    zipf = 1 / np.arange(1, 129) ** 1.1
    hits = np.concatenate([[0.0], np.cumsum(zipf / zipf.sum())])
    n = np.arange(129)
    per_expert = 2_654_208
    elsewhere = np.where(n < 128, 40 / 64, 0.0)  # uploads per prompt token with n slots
    hottest = np.maximum(40 - n, 0) / 64

    def layers(weight: float, uploads: np.ndarray) -> list[LayerCost]:
        return [LayerCost(per_expert, 128, 8, hits, prefill=uploads.astype(np.float64), prefill_batches=1 / 64,
                          prefill_weight=weight) for _ in range(48)]

    def stock(whole: int) -> list[int]:
        return [128] * whole + [0] * (48 - whole)

    room = int(44.3 * 128) * per_expert
    decode_only, factor = allocate_against_stock(layers(0.0, elsewhere), room, stock(45))
    assert factor == 1 and sum(0 < k < 128 for k in decode_only) == 5  # decode alone: spread
    costs = layers(1.0, elsewhere)
    assert modelled_prompt_seconds(costs, decode_only) > modelled_prompt_seconds(costs, stock(45), stock=True)
    got, factor = allocate_against_stock(costs, room, stock(45))
    assert factor > 1 and sum(k < 128 for k in got) < 5, (factor, got)
    assert modelled_prompt_seconds(costs, got) <= modelled_prompt_seconds(costs, stock(45), stock=True)
    wide = layers(1.0, hottest)
    got, factor = allocate_against_stock(wide, 20 * 128 * per_expert, stock(20))
    assert factor == 1 and sum(0 < k < 128 for k in got) > 20
    assert modelled_prompt_seconds(wide, got) < modelled_prompt_seconds(wide, stock(20), stock=True)
    flat = [LayerCost(64_000, 128, 8, uniform_hits(128)) for _ in range(48)]
    got, _ = allocate_against_stock(flat, int(20.5 * 128) * 64_000, stock(21))
    assert got == stock(21)


def test_prompt_cost_prints_the_planner_s_prompt_model(patched_build, fixture_models, tmp_path: Path) -> None:
    """native/bench/prompt_cost.py on a real profile: distinct experts per prompt batch for every
    layer, and one row for the stock rule and one per prefill weight."""
    import sys

    model = fixture_models["qwen3moe"]
    info = inspect_model(model)
    profile = make_profile(patched_build, model, tmp_path / "p.profile.gguf", 8)
    budget = fixed_bytes(info, 4096) + info.expert_bytes // 2
    script = Path(__file__).parents[1] / "native" / "bench" / "prompt_cost.py"
    r = subprocess.run([sys.executable, str(script), str(model), str(profile), "--budget", str(budget),
                        "--weights", "0,1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("distinct experts per prompt batch"))
    distinct = [int(x) for x in line.split(":")[1].split()]
    assert len(distinct) == len(info.layers) and all(1 <= d <= info.n_expert for d in distinct)
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "placement" not in ln]
    assert len(rows) == 3 and "stock --fit's rule" in rows[0] and "prefill weight 1" in rows[2], r.stdout
    bad = subprocess.run([sys.executable, str(script), str(model), str(tmp_path / "none.gguf")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_hit_curves_split_by_prompt() -> None:
    """A router that favours a different set of experts in each prompt (the context steers it, as on
    the random-weight benchmark model) but none across prompts: slots fixed from other prompts hit
    at the uniform rate, and the curve says so. A split of the same prompts' tokens would not."""
    rng = np.random.default_rng(2)
    n_prompts, n_tokens, n_layers, n_expert, k = 16, 64, 2, 128, 8
    steps, meta = [], []
    for prompt in range(n_prompts):
        favoured = rng.choice(n_expert, 16, replace=False)
        weights = np.full(n_expert, 1.0)
        weights[favoured] = 20.0
        for pos in range(n_tokens):
            steps.append([rng.choice(n_expert, k, replace=False, p=weights / weights.sum()) for _ in range(n_layers)])
            meta.append([prompt, pos, 0])
    seq, meta_arr = np.array(steps, dtype=np.int16), np.array(meta, dtype=np.int32)
    counts = np.stack([np.bincount(seq[:, i].ravel(), minlength=n_expert) for i in range(n_layers)])
    prof = Profile(fingerprint=None, tensors=[f"blk.{i}.ffn_down_exps.weight" for i in range(n_layers)],  # type: ignore[arg-type]
                   counts_prefill=counts, counts_decode=counts * 0,
                   sources=[ProfileSource("t", ["p"] * n_prompts, seq, meta_arr)])
    by_prompt = hit_curves(prof, n_layers, n_expert)
    assert abs(by_prompt[:, 32].mean() - 0.25) < 0.05
    even, odd = (_layer_counts(seq[i::2].astype(np.int64), n_layers, n_expert) for i in (0, 1))
    by_token = np.mean([_curve(even[i], even[i] * 0, odd[i])[32] for i in range(n_layers)])
    assert by_token > 0.33


def test_hit_curves_rank_as_the_server_fills_its_slots() -> None:
    """One ranking on both sides: each fold's experts ranked as llama-server fills its slots from a
    profile (allocate.slot_order: generated tokens' selections first, then the prompts'), scored on the
    other fold's selections of both. Two prompts whose prompt tokens pick experts 4-7 and whose
    generated tokens pick 0-3, fewer times: the top 4 are 0-3, serving the generated tokens' share of
    the traffic, not 4-7's larger prompt share that a ranking by all selections would claim."""
    n_expert, k = 8, 2
    steps, meta = [], []
    for prompt in range(2):
        for pos in range(30):  # prompt tokens: experts 4-7
            steps.append([[4 + pos % 4, 4 + (pos + 1) % 4]])
            meta.append([prompt, pos, PHASE_PREFILL])
        for pos in range(30, 40):  # generated tokens: experts 0-3
            steps.append([[pos % 4, (pos + 1) % 4]])
            meta.append([prompt, pos, PHASE_DECODE])
    seq, meta_arr = np.array(steps, dtype=np.int16), np.array(meta, dtype=np.int32)
    decode = np.bincount(seq[meta_arr[:, 2] == PHASE_DECODE].ravel(), minlength=n_expert)[None, :]
    prefill = np.bincount(seq[meta_arr[:, 2] == PHASE_PREFILL].ravel(), minlength=n_expert)[None, :]
    prof = Profile(fingerprint=None, tensors=["blk.0.ffn_down_exps.weight"],  # type: ignore[arg-type]
                   counts_prefill=prefill, counts_decode=decode,
                   sources=[ProfileSource("t", ["a", "b"], seq, meta_arr)])
    assert sorted(slot_order(decode[0], prefill[0])[:4]) == [0, 1, 2, 3]
    curve = hit_curves(prof, 1, n_expert)
    assert curve[0, 4] == pytest.approx(10 / 40)  # the generated tokens' share: what those slots serve
    assert served_share(prof, [4], decode + prefill) == [pytest.approx(10 / 40)]
    # without sequences: the same ranking over the profile's counts, scored on its generated tokens
    assert hit_curves(replace(prof, sources=[]), 1, n_expert)[0, 4] == pytest.approx(1.0)


def test_warnings_at_20_and_15_percent(tmp_path: Path) -> None:
    from moeplug.model.synth import ModelSpec, make_model

    path = make_model(ModelSpec(arch="qwen3moe", layers=2, experts=20, used=2, embd=64, expert_ff=64,
                                   dtype="f16", seed=3), tmp_path / "m20.gguf")[0]
    info = inspect_model(path)
    per_slot = sum(layer.bytes_per_expert for layer in info.layers)

    def slots_of(n: int):
        return plan_with(info, 1024, fixed_bytes(info, 1024) + n * per_slot)

    assert slots_of(5).warnings == []  # 25%
    assert slots_of(4).warnings == []  # 20%: at the threshold, not below
    w = slots_of(3).warnings  # 15%
    assert len(w) == 1 and "below 20%" in w[0]
    w = slots_of(2).warnings  # 10%
    assert len(w) == 1 and "below 15%" in w[0] and "--cpu-moe speed" in w[0]


def test_stock_ncmoe_keeps_the_last_layers_on_the_gpu(fixture_models) -> None:
    info = inspect_model(fixture_models["hy_v3"])  # block 0 is dense: MoE blocks 1 and 2
    layer = info.layers[0].expert_bytes
    assert stock_ncmoe(info, 2 * layer) == 0
    assert stock_ncmoe(info, layer) == 2  # experts of blocks 0-1 in RAM, block 2's on the GPU
    assert stock_ncmoe(info, 0) == info.n_layer


def test_budget_too_small_is_a_clear_error(fixture_models) -> None:
    info = inspect_model(fixture_models["qwen3moe"])
    with pytest.raises(MoeplugError, match="does not hold the model's other weights"):
        plan_with(info, 2048, 64 * MIB)


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
    for key in ("slots_per_layer", "slots_total", "whole_layers", "fit_fraction", "vram_budget_bytes",
                "expert_vram_bytes", "predicted_hit_rate", "warnings", "stock_ncmoe", "modelled_host_ms",
                "server_args"):
        assert key in doc, key
    assert doc["vram_budget_bytes"] == 2 << 30 and doc["slots_per_layer"] == [8, 8, 8] and doc["whole_layers"] == 3
    assert doc["prefill_weight"] == 1.0  # the default: as many prompt tokens as generated ones


def test_cli_plan_prefill_weight(patched_build, fixture_models, tmp_path: Path) -> None:
    """`plan --prefill-weight W` plans for W prompt tokens per generated token (kept in the plan);
    with a real profile a heavier weight never models the prompt side worse; out of range is one line."""
    model = fixture_models["qwen3moe"]
    info = inspect_model(model)
    profile = make_profile(patched_build, model, tmp_path / "p.profile.gguf", 8)
    budget = str(fixed_bytes(info, 2048) + info.expert_bytes // 2)
    docs = {}
    for w in ("0", "8"):
        r = run_cli("plan", str(model), "--vram-budget", budget, "--ctx", "2048", "--profile", str(profile),
                    "--prefill-weight", w, "--json")
        assert r.returncode == 0, r.stderr
        docs[w] = json.loads(r.stdout)
        assert docs[w]["prefill_weight"] == float(w)
    costs = layer_costs_of(info, read_profile(profile), 1.0)

    def prompt(slots: list[int]) -> float:
        return sum(float(c.prompt_seconds(np.array(n))) for c, n in zip(costs, slots) if n < info.n_expert)

    assert prompt(docs["8"]["slots_per_layer"]) <= prompt(docs["0"]["slots_per_layer"])
    # the plan's prompt side, never modelled slower than stock's placement (allocate_against_stock)
    assert docs["0"]["modelled_prompt_us"] is None and docs["8"]["modelled_prompt_us"] is not None  # 0: decode only
    assert docs["8"]["modelled_prompt_us"] <= docs["8"]["stock_modelled_prompt_us"] * (1 + 1e-9)
    text = run_cli("plan", str(model), "--vram-budget", budget, "--ctx", "2048", "--profile", str(profile)).stdout
    assert f"{docs['8']['stock_modelled_prompt_us']:.1f} us" in text.split("modelled prompt uploads per prompt token")[1]
    for bad in ("-1", "1001", "x"):
        r = run_cli("plan", str(model), "--prefill-weight", bad)
        assert r.returncode == 2 and "--prefill-weight" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.native
def test_the_prefill_weight_is_kept_with_the_installed_plan(patched_build, fixture_models, tmp_path: Path) -> None:
    """install --prefill-weight W stores W in the plan; plan reuses it (or previews another without
    storing it); serve --prefill-weight re-plans, serves and keeps the new one."""
    env = xdg_homes(tmp_path / "home")
    r = run_cli_process("install", str(fixture_models["qwen3moe"]), "--ctx", "512", "--no-serve", "--profile-tokens", "8",
                        "--prefill-weight", "3", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    name = json.loads(r.stdout)["name"]

    def stored() -> float:
        return json.loads(run_cli_process("list", "--json", env=env).stdout)["models"][0]["plan"]["prefill_weight"]

    assert stored() == 3.0
    assert json.loads(run_cli_process("plan", name, "--json", env=env).stdout)["prefill_weight"] == 3.0
    assert json.loads(run_cli_process("plan", name, "--prefill-weight", "0", "--json", env=env).stdout)["prefill_weight"] == 0.0
    assert stored() == 3.0  # plan only previews
    r = run_cli_process("serve", name, "--prefill-weight", "2", "--json", env=env)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        run_cli_process("stop", "--all", env=env)
    assert stored() == 2.0


def served_once(env: dict[str, str], *command: str, during: Callable[[dict], None] | None = None) -> dict:
    """A moeplug command that starts a server (install, serve), run with --json: its reply, after
    `during` (given that reply) while the server runs; the server stopped again whatever happened."""
    r = run_cli_process(*command, "--json", env=env)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        done = json.loads(r.stdout)
        if during is not None:
            during(done)
        return done
    finally:
        run_cli_process("stop", "--all", env=env)


def stored_plan(env: dict[str, str]) -> dict:
    """The installed model's plan as `moeplug list` shows it (one model installed)."""
    return json.loads(run_cli_process("list", "--json", env=env).stdout)["models"][0]["plan"]


def out_of_range_is_one_line(env: dict[str, str], name: str, flag: str, values: Sequence[str]) -> None:
    for bad in values:
        r = run_cli_process("plan", name, flag, bad, env=env)
        assert r.returncode == 2 and flag in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.native
def test_the_threads_asked_for_reach_the_server_and_stay_with_the_plan(patched_build, fixture_models,
                                                                      tmp_path: Path) -> None:
    """install --threads N stores N with the plan and the server runs on N threads (its log says so);
    plan previews another count without storing it; serve --threads 0 re-plans for llama.cpp's
    default and keeps that; out of range is one line."""
    env = xdg_homes(tmp_path / "home")
    done = served_once(env, "install", str(fixture_models["qwen3moe"]), "--ctx", "512", "--profile-tokens", "8",
                       "--threads", "1")
    assert done["plan"]["threads"] == 1 and done["plan"]["server_args"][-2:] == ["-t", "1"]
    log = Path(done["server"]["log"]).read_text()
    assert re.search(r"n_threads = 1 \(n_threads_batch = 1\)", log), log[-2000:]
    name = done["name"]
    assert json.loads(run_cli_process("plan", name, "--json", env=env).stdout)["threads"] == 1
    preview = json.loads(run_cli_process("plan", name, "--threads", "2", "--json", env=env).stdout)
    assert preview["threads"] == 2 and stored_plan(env)["threads"] == 1  # plan only previews
    log = Path(served_once(env, "serve", name, "--threads", "0")["server"]["log"]).read_text()
    assert not re.search(r"n_threads = 1 \(", log)
    stored = stored_plan(env)
    assert (stored["threads"], stored["threads_asked"]) == (None, 0) and "-t" not in stored["server_args"]
    out_of_range_is_one_line(env, name, "--threads", ("-1", "1025", "many"))


@pytest.mark.native
def test_the_ubatch_asked_for_reaches_the_server_and_stays_with_the_plan(patched_build, fixture_models,
                                                                       tmp_path: Path) -> None:
    """install --ubatch N stores N with the plan and the server runs prompt batches of N (its log says
    so); plan previews another without storing it; serve --ubatch re-plans and keeps the new one, and a
    prompt longer than the ubatch is answered; out of range is one line."""
    from moeplug.serving.client import complete

    env = xdg_homes(tmp_path / "home")
    done = served_once(env, "install", str(fixture_models["qwen3moe"]), "--ctx", "512", "--profile-tokens", "8",
                       "--ubatch", "64")
    assert done["plan"]["ubatch"] == 64 and done["plan"]["server_args"][2:6] == ["-b", "2048", "-ub", "64"]
    log = Path(done["server"]["log"]).read_text()
    assert re.search(r"n_ubatch += 64\n", log), log[-2000:]
    name = done["name"]
    assert json.loads(run_cli_process("plan", name, "--json", env=env).stdout)["ubatch"] == 64
    preview = json.loads(run_cli_process("plan", name, "--ubatch", "128", "--json", env=env).stdout)
    assert preview["ubatch"] == 128 and stored_plan(env)["ubatch"] == 64  # plan only previews
    assert "prompt batch" in run_cli_process("plan", name, env=env).stdout

    def long_prompt(served: dict) -> None:
        got = complete(served["server"]["url"], list(range(1, 101)), 4, ignore_eos=True)
        assert got["timings"]["prompt_n"] == 100  # four batches of 32 tokens, the last partly full

    served = served_once(env, "serve", name, "--ubatch", "32", "--prompt-tokens", "100", during=long_prompt)
    assert re.search(r"n_ubatch += 32\n", Path(served["server"]["log"]).read_text())
    stored = stored_plan(env)
    assert stored["ubatch"] == 32 and stored["server_args"][2:6] == ["-b", "2048", "-ub", "32"]
    assert (stored["ubatch_asked"], stored["prompt_tokens"]) == (32, 100)
    # auto: the planner's choice, here llama.cpp's 512 (a CPU plan weighs no other); the prompt length is kept
    auto = json.loads(run_cli_process("plan", name, "--ubatch", "auto", "--json", env=env).stdout)
    assert (auto["ubatch"], auto["ubatch_asked"], auto["prompt_tokens"]) == (512, 0, 100)
    assert "-ub" not in auto["server_args"]
    out_of_range_is_one_line(env, name, "--ubatch", ("16", "65537", "many"))
    out_of_range_is_one_line(env, name, "--prompt-tokens", ("-1", "many"))


def test_cli_plan_without_gpu_is_a_cpu_plan(fixture_models) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    if doc["backend"] == "cpu":  # this machine has no NVIDIA GPU
        assert doc["slots_per_layer"] == [0, 0, 0] and any("no NVIDIA GPU" in n for n in doc["notes"])


def test_cli_plan_bad_budget(fixture_models) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", "lots")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is not a size" in r.stderr


@pytest.mark.native
def test_llama_fit_estimate_is_what_the_server_allocates(patched_build, fixture_models, tmp_path: Path) -> None:
    """The whole budget rests on llama.cpp's own estimate (llama-fit-params --fit-print, moeplug.planner.fit_estimate):
    on this CPU build its Host line (weights, context, compute, whole MiB) is what llama-server then
    allocates, to the MiB; without a GPU gpu_need is None and the planner keeps its own estimate; with
    one, the experts get the budget less the estimate and the CUDA context reserve."""
    from moeplug.planner.fit_estimate import DeviceNeed, gpu_need, parse_fit_print

    model, ctx = fixture_models["qwen3moe"], 1024
    tool = patched_build.binary("llama-fit-params")
    r = subprocess.run([str(tool), "-m", str(model), "-c", str(ctx), "-ngl", "99", "--cpu-moe", "--fit-print", "on"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    host = next(line.split() for line in r.stdout.splitlines() if line.startswith("Host "))
    est = dict(zip(("model", "KV", "compute"), (int(x) for x in host[1:4])))
    assert parse_fit_print(r.stdout) == []  # no device line: a CPU build
    with start_server(patched_build.binary("llama-server"), model, tmp_path / "srv.log", ctx=ctx, threads=2,
                      extra_args=["-np", "1", "-lm", "none", "-lv", "4"]) as srv:
        srv.wait_healthy()
    buffers = parse_buffers((tmp_path / "srv.log").read_text())
    for kind, mib in est.items():
        assert mib <= sum(buffers[kind].values()) < mib + 1, (kind, mib, buffers[kind])

    info = inspect_model(model)
    assert gpu_need(tool, model, ctx) is None
    assert plan_with(info, ctx, 2 << 30).vram_source == "estimate"
    need = DeviceNeed("CUDA0", model=64 * MIB, context=8 * MIB, compute=32 * MIB)
    plan = plan_with(info, ctx, 2 << 30, need=need)
    assert plan.vram_source == "llama-fit-params" and plan.margin_bytes == DEFAULT_COSTS.cuda_context_reserve
    assert (plan.non_expert_vram_bytes, plan.kv_cache_bytes, plan.compute_bytes) == (64 * MIB, 8 * MIB, 32 * MIB)


@pytest.mark.native
def test_serve_plans_again_a_model_an_older_planner_planned(patched_build, fixture_models, tmp_path: Path) -> None:
    """A plan stored by an older planner (plan.PLANNER_REVISION above its `planner`, or none at all: a
    record from before revisions) is made again by `moeplug serve`, with the model's stored budget,
    context and choices, kept, and said in one line; a current plan is served as stored. A hook's
    configuration (a proxy starts the servers) is written from the plan made again too. Where the
    profile it was planned from is gone, the old plan is served rather than one without the cache."""
    from moeplug.planner.record import PLANNER_REVISION

    env = xdg_homes(tmp_path / "home")
    r = run_cli_process("install", str(fixture_models["qwen3moe"]), "--ctx", "512", "--no-serve", "--profile-tokens", "8",
                        "--prefill-weight", "3", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    name = json.loads(r.stdout)["name"]
    record = Path(env["XDG_DATA_HOME"]) / "moeplug" / "installed" / f"{name}.json"
    current = json.loads(record.read_text())
    assert current["plan"]["planner"] == PLANNER_REVISION

    def serve() -> tuple[str, dict]:
        r = run_cli_process("serve", name, "--json", env=env)
        try:
            assert r.returncode == 0, r.stderr[-3000:]
        finally:
            run_cli_process("stop", "--all", env=env)
        return r.stderr, json.loads(record.read_text())

    said, after = serve()
    assert "older moeplug planner" not in said and after == current  # current: served as stored
    old = json.loads(json.dumps(current))
    del old["plan"]["planner"]  # a record from before revisions, with what an old rule put in its flags
    old["plan"]["server_args"] += ["-t", "1"]
    old["plan"]["threads"] = 1
    record.write_text(json.dumps(old))
    said, after = serve()
    assert f"{name}: its plan was made by an older moeplug planner; planned again" in said, said[-2000:]
    assert after["plan"]["planner"] == PLANNER_REVISION and after["plan"]["server_args"] == current["plan"]["server_args"]
    assert after["plan"]["threads"] is None and after["plan"]["prefill_weight"] == 3.0 and after["ctx"] == 512
    record.write_text(json.dumps(old))  # a proxy's hook starts servers without moeplug serve: it re-plans too
    r = run_cli_process("hook", "llama-server", "--print", "--json", env=env)
    assert r.returncode == 0 and f"{name}: its plan was made by an older moeplug planner" in r.stderr, r.stderr[-2000:]
    section = json.loads(r.stdout)["sections"][name]
    assert "\nt = 1\n" not in section and json.loads(record.read_text())["plan"] == after["plan"]  # the preset's -t
    gone = json.loads(json.dumps(old))
    gone["profile"] = str(tmp_path / "deleted.profile.gguf")
    record.write_text(json.dumps(gone))
    said, after = serve()
    assert "older moeplug planner" not in said and after == gone
