"""Speculative decoding in the plan: the draft's VRAM counted (a draft model, an MTP head), its
flags carried to llama-server and kept for `serve`, the slots spread for verification batches,
and the bad inputs refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers import one_line_error, plan_with, run_cli, run_cli_process, xdg_homes

from moeplug.planner.allocate import LayerCost, _curve, allocate
from moeplug.planner.estimates import compute_buffer_bytes, kv_cache_bytes
from moeplug.model.inspect import inspect_model
from moeplug.serving.server import start_server
from moeplug.serving.launch import parse_buffers
from moeplug.planner.speculation import DEFAULT_DRAFT_MAX, Speculation, draft_compute_bytes, nextn_weight_bytes, spec_need
from moeplug.model.synth import ModelSpec, make_model
from moeplug.planner.costs import DEFAULT_COSTS

MIB = 1 << 20


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small draft with the fixture models' built-in vocab (the generator makes MoE models only)."""
    spec = ModelSpec(arch="qwen3moe", layers=2, experts=4, used=1, embd=256, expert_ff=256, heads=4, heads_kv=2,
                     head_dim=64, dtype="q8_0", seed=11)
    return make_model(spec, tmp_path_factory.mktemp("draft") / "draft.gguf")[0]


def others(info, ctx: int) -> int:
    """The planner's estimate of the GPU's buffers beside the experts and the draft."""
    return info.non_expert_bytes + kv_cache_bytes(info, ctx) + compute_buffer_bytes(info) + DEFAULT_COSTS.cuda_pool_headroom + \
        DEFAULT_COSTS.safety_margin


# ---------------------------------------------------------------------------------------------
# the cost model


def test_one_token_per_step_is_todays_cost_model_exactly() -> None:
    """tokens_per_step 1 (the default) is the per-token model as it was, bit for bit, and so are
    the plans made from it."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(4, 40))
        p = np.sort(rng.dirichlet(np.full(n, rng.uniform(0.1, 3))))[::-1]
        hits = np.concatenate([[0.0], np.cumsum(p)])
        layer, used, b = LayerCost(2_654_208, n, 4, hits), 4, 2_654_208
        slots = np.arange(n + 1)
        before = np.where(slots >= n, 0.0, DEFAULT_COSTS.round_trip_s + np.where(slots > 0, DEFAULT_COSTS.slot_pass_s, 0.0)
                          + used * (1.0 - hits[slots]) * b / DEFAULT_COSTS.cpu_expert_bytes_per_s)  # the model before batches
        assert np.array_equal(layer.seconds(slots), before)
        assert np.array_equal(LayerCost(b, n, 4, hits, 1).seconds(slots), before)


def test_batch_misses_match_a_simulation() -> None:
    """Expected distinct missed experts of a k-token batch against batches drawn at random, each
    expert picked by a token with its per-token probability."""
    rng = np.random.default_rng(8)
    counts = np.array([900, 500, 300, 200, 100, 60, 40, 20, 10, 5, 5, 4, 3, 2, 1, 1], float)
    used = 2
    layer = LayerCost(1, len(counts), used, _curve(counts, counts * 0, counts), tokens_per_step=4)
    p = used * counts / counts.sum()  # per-token probability of each expert, ranked
    draws = rng.random((40_000, 4, len(counts))) < p  # [batch, token, expert]
    picked = draws.any(axis=1)
    for n_slots in (0, 3, 8, 15):
        simulated = picked[:, n_slots:].sum(axis=1).mean()
        assert layer.missed_experts(np.array(n_slots)) == pytest.approx(simulated, rel=0.02, abs=0.01)
    # a batch reads a shared expert once: fewer than k times the per-token misses
    one = LayerCost(1, len(counts), used, _curve(counts, counts * 0, counts))
    assert layer.missed_experts(np.array(3)) < 4 * one.missed_experts(np.array(3))


def test_batches_give_a_flat_layer_slots_a_skewed_one_had() -> None:
    """A skewed layer's hot experts serve a batch about as often as a token, a flat layer's rarely
    picked ones up to k times as often: with batches of 4 the flat layer gains slots."""
    n, bpe = 32, 2_654_208
    skewed = np.array([4000, 3000, 2500, 2000] + [60] * 28, float)
    flat = np.full(n, 300.0) + np.arange(n)[::-1]

    def layers(k: int) -> list[LayerCost]:
        return [LayerCost(bpe, n, 4, _curve(c, c * 0, c), k) for c in (skewed, flat)]

    one, four = allocate(layers(1), 8 * bpe), allocate(layers(4), 8 * bpe)
    assert sum(one) == sum(four) == 8
    assert four[1] > one[1] and four[0] < one[0], (one, four)


# ---------------------------------------------------------------------------------------------
# the draft's VRAM


def test_a_draft_model_is_counted_in_the_budget(fixture_models, draft: Path, tmp_path: Path) -> None:
    """Its weights (every tensor on the GPU but the token embeddings, which llama.cpp keeps in RAM),
    its KV cache at the served context, its compute buffer: off the experts' room; the flags name
    it; too small a budget says so in one line."""
    info, d, ctx = inspect_model(fixture_models["qwen3moe"]), inspect_model(draft), 2048
    layer = info.layers[0].expert_bytes
    spec = Speculation("draft", str(draft))
    names = {t.name for t in d.tensors}
    assert "output.weight" in names and "token_embd.weight" in names  # untied: the embeddings stay in RAM
    weights = d.total_bytes - next(t.n_bytes for t in d.tensors if t.name == "token_embd.weight")
    need = weights + kv_cache_bytes(d, ctx) + compute_buffer_bytes(d) + DEFAULT_COSTS.cuda_pool_headroom // 4
    budget = others(info, ctx) + need + int(1.5 * layer)
    plan = plan_with(info, ctx, budget, spec=spec)
    assert plan.draft_weights_bytes == weights
    assert plan.draft_kv_cache_bytes == ctx * 2 * 2 * (64 + 64) * 2  # 2 layers x 2 KV heads x (K + V) x f16
    assert plan.draft_weights_bytes + plan.draft_kv_cache_bytes + plan.draft_compute_bytes == need
    assert plan.whole_layers == 1 and plan.expert_vram_bytes <= budget - others(info, ctx) - need
    assert plan_with(info, ctx, budget).whole_layers == 3  # the draft's bytes went to experts without it
    args = plan.server_args
    i = args.index("-md")
    assert args[i:i + 8] == ["-md", str(draft), "-ngld", "99", "--spec-type", "draft-simple",
                             "--spec-draft-n-max", str(DEFAULT_DRAFT_MAX)]
    assert plan.tokens_per_step == DEFAULT_DRAFT_MAX + 1 and plan.speculation["tokens_per_step"] == 4

    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", f"{budget}", "--ctx", str(ctx),
                "--draft", str(draft), "--spec-draft-max", "5", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["draft_weights_bytes"] == weights and doc["draft_kv_cache_bytes"] == plan.draft_kv_cache_bytes
    assert doc["speculation"]["kind"] == "draft" and doc["tokens_per_step"] == 6
    assert doc["server_args"][-2:] == ["--spec-draft-n-max", "5"]
    human = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", f"{budget}", "--ctx", str(ctx),
                    "--spec", f"draft:{draft}").stdout
    assert "draft weights" in human and "draft KV cache (2048 tokens)" in human and "-md " in human

    small = others(info, ctx) + need - 1  # room for everything but the draft's last byte
    assert plan_with(info, ctx, small).slots_total > 0
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", str(small), "--ctx", str(ctx),
                "--draft", str(draft))
    one_line_error(r, 1, "does not hold the draft", "KV cache at 2048 tokens", "without --spec")


def test_an_mtp_head_is_counted_and_kept_on_the_gpu(fixture_models) -> None:
    """--mtp: the NextN block's weights, its KV cache and compute are the draft's, its experts a
    whole layer no -ot names; without it that layer gets no slot (nothing runs it) and its
    experts stay in RAM."""
    info, ctx = inspect_model(fixture_models["hy_v3-mtp"]), 1024
    mtp_block = info.layers[-1].block
    assert mtp_block == info.n_layer - 1
    nextn = sum(t.n_bytes for t in info.tensors if t.name.startswith(f"blk.{mtp_block}."))
    budget = others(info, ctx) + spec_need(info, Speculation("mtp"), ctx).total + 64 * MIB
    plan = plan_with(info, ctx, budget, spec=Speculation("mtp"))
    assert plan.draft_weights_bytes == nextn == nextn_weight_bytes(info)
    assert plan.draft_kv_cache_bytes == ctx * 1 * 2 * (64 + 64) * 2  # the NextN block's attention only
    assert plan.draft_compute_bytes == draft_compute_bytes(info)
    assert plan.slots_per_layer[-1] == info.n_expert
    assert f"blk\\.({mtp_block})" not in " ".join(plan.server_args) and "--cpu-moe" not in plan.server_args
    assert plan.server_args[-4:] == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    # the NextN block's other weights are not counted twice
    assert plan.non_expert_vram_bytes == info.non_expert_bytes - (nextn - info.layers[-1].expert_bytes)

    plain = plan_with(info, ctx, budget)
    assert plain.slots_per_layer[-1] == 0 and plain.speculation is None and plain.draft_weights_bytes == 0
    ot = plain.server_args[plain.server_args.index("-ot") + 1]
    assert re.search(ot.rsplit("=", 1)[0], f"blk.{mtp_block}.ffn_down_exps.weight")
    # a budget with room for experts but not the MTP head: the trunk's experts all in RAM, the head's on the GPU
    tight = others(info, ctx) - (nextn - info.layers[-1].expert_bytes) + plan.draft_weights_bytes + \
        plan.draft_kv_cache_bytes + plan.draft_compute_bytes
    squeezed = plan_with(info, ctx, tight, spec=Speculation("mtp"))
    assert squeezed.slots_per_layer == [0] * (len(info.layers) - 1) + [info.n_expert]
    assert "--cpu-moe" not in squeezed.server_args and "-ot" in squeezed.server_args


def test_bad_speculation_is_one_line(fixture_models, tmp_path: Path) -> None:
    model = str(fixture_models["qwen3moe"])
    one_line_error(run_cli("plan", model, "--spec", "foo"), 2, "--spec 'foo'", "draft:PATH, mtp, ngram")
    one_line_error(run_cli("plan", model, "--spec", "draft:"), 2, "names no file")
    one_line_error(run_cli("plan", model, "--spec", f"draft:{tmp_path / 'missing.gguf'}"), 1, "no such file")
    one_line_error(run_cli("plan", model, "--draft", str(tmp_path / "missing.gguf")), 1, "no such file")
    one_line_error(run_cli("plan", model, "--mtp"), 1, "no MTP (NextN) block")
    one_line_error(run_cli("plan", model, "--spec-draft-max", "4"), 2, "needs a --spec")
    one_line_error(run_cli("plan", model, "--spec", "mtp", "--spec-draft-max", "0"), 2, "out of range")
    one_line_error(run_cli("install", model, "--spec", "foo", "--no-serve"), 2, "--spec 'foo'")
    one_line_error(run_cli("serve", "nothing-installed", "--spec", "draft"), 2, "--spec 'draft'")
    r = run_cli("plan", model, "--mtp", "--spec", "ngram")
    assert r.returncode == 2 and "not allowed with" in r.stderr


# ---------------------------------------------------------------------------------------------
# real servers


def spec_section(log: str, marker: str) -> str:
    """The log from the draft's start on."""
    assert marker in log, log[-3000:]
    return log[log.index(marker):]


@pytest.mark.parametrize("kind", ["mtp", "draft"])
def test_llama_server_speculates_with_the_planned_flags(patched_build, fixture_models, draft: Path, tmp_path: Path,
                                                        kind: str) -> None:
    """The plan's flags start llama-server's speculative context; the draft's KV cache is what the
    planner counted, its compute buffer within the estimate, and drafts are made."""
    model, ctx = fixture_models["hy_v3-mtp"], 512
    info = inspect_model(model)
    spec = Speculation("mtp") if kind == "mtp" else Speculation("draft", str(draft))
    plan = plan_with(info, ctx, None, spec=spec)  # the CPU plan: -ngl 0 (-ngld 0)
    log_path = tmp_path / "srv.log"
    with start_server(patched_build.binary("llama-server"), model, log_path, ctx=None, threads=2,
                      extra_args=["-np", "1", "-lv", "4", "-lm", "none", *plan.server_args]) as srv:
        srv.wait_healthy()
        r = requests.post(f"{srv.url}/completion", json={"prompt": "def main():", "n_predict": 16, "temperature": 0},
                          timeout=120)
        r.raise_for_status()
    log = log_path.read_text()
    marker = "creating MTP draft context" if kind == "mtp" else f"loading draft model '{draft}'"
    section = spec_section(log, marker)
    spec_type = "draft-mtp" if kind == "mtp" else "draft-simple"
    assert f"adding speculative implementation '{spec_type}'" in section
    assert "speculative decoding context initialized" in section
    buffers = parse_buffers(section.split("adding speculative implementation")[0])
    assert sum(buffers["KV"].values()) * MIB == pytest.approx(plan.draft_kv_cache_bytes, abs=0.01 * MIB)
    assert max(buffers["compute"].values()) * MIB <= plan.draft_compute_bytes
    if kind == "draft":  # every weight in a host buffer here; the plan's are those a GPU would hold
        embd = next(t.n_bytes for t in inspect_model(draft).tensors if t.name == "token_embd.weight")
        assert sum(buffers["model"].values()) * MIB == pytest.approx(plan.draft_weights_bytes + embd, rel=0.02)
    drafted = re.search(rf"{spec_type}: .*#gen drafts = +(\d+)", log)
    assert drafted and int(drafted[1]) > 0, log[-2000:]


@pytest.mark.native
def test_install_keeps_the_speculation_for_serve(patched_build, fixture_models, tmp_path: Path) -> None:
    """install --spec mtp stores it in the plan; plan and serve reuse it; serve --spec none drops it."""
    env = xdg_homes(tmp_path / "home")
    model = fixture_models["hy_v3-mtp"]
    r = run_cli_process("install", str(model), "--ctx", "512", "--no-serve", "--spec", "mtp", "--profile-tokens", "8",
                        "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    name = json.loads(r.stdout)["name"]
    listed = json.loads(run_cli_process("list", "--json", env=env).stdout)["models"]
    assert listed[0]["plan"]["speculation"]["kind"] == "mtp"
    again = json.loads(run_cli_process("plan", name, "--json", env=env).stdout)
    assert again["speculation"]["kind"] == "mtp" and "draft-mtp" in again["server_args"]
    longer = json.loads(run_cli_process("plan", name, "--spec-draft-max", "5", "--json", env=env).stdout)
    assert longer["speculation"]["n_draft"] == 5 and longer["tokens_per_step"] == 6
    r = run_cli_process("serve", name, "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        server = json.loads(r.stdout)["server"]
        assert server["args"][-4:] == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
        assert "speculative decoding context initialized" in Path(server["log"]).read_text()
    finally:
        assert run_cli_process("stop", name, env=env).returncode == 0
    r = run_cli_process("serve", name, "--spec", "none", "--json", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    try:
        assert "--spec-type" not in json.loads(r.stdout)["server"]["args"]
    finally:
        run_cli_process("stop", "--all", env=env)
    listed = json.loads(run_cli_process("list", "--json", env=env).stdout)["models"]
    assert listed[0]["plan"]["speculation"] is None


def test_llama_cpp_s_estimate_of_the_draft_replaces_moeplug_s(fixture_models, draft: Path) -> None:
    """Where llama-fit-params measured the draft alone (a GPU), its weights and context are what the
    plan takes off the budget; of its compute figure, not the ubatch of logits over the vocabulary
    that the CUDA server does not hold, and what the draft context measured beyond it instead."""
    from moeplug.planner.estimates import logits_bytes
    from moeplug.planner.fit_estimate import DeviceNeed

    info, ctx = inspect_model(fixture_models["qwen3moe"]), 2048
    spec = Speculation("draft", str(draft))
    logits = logits_bytes(inspect_model(draft, dense_ok=True))
    assert 0 < logits < 7 * MIB
    measured = DeviceNeed("CUDA0", 3 * MIB, 5 * MIB, 7 * MIB)
    plan = plan_with(info, ctx, 1 << 40, spec=spec, draft_need=measured)
    assert (plan.draft_weights_bytes, plan.draft_kv_cache_bytes, plan.draft_compute_bytes) == \
        (3 * MIB, 5 * MIB, 7 * MIB - logits + DEFAULT_COSTS.draft_context_extra)
    small = plan_with(info, ctx, 1 << 40, spec=spec, draft_need=DeviceNeed("CUDA0", 3 * MIB, 5 * MIB, logits // 2))
    assert small.draft_compute_bytes == DEFAULT_COSTS.draft_context_extra  # never below what the context measured


def test_the_plan_says_what_acceptance_pays_for_a_verification_batch(patched_build, fixture_models, draft: Path,
                                                                      tmp_path: Path) -> None:
    """With a profile and experts in RAM, the plan notes the modelled host time of a batch of
    k = draft + 1 tokens against one token's, and the acceptance at which a step yields that many
    tokens: more drafted tokens cost more per batch and need at least as much acceptance."""
    from helpers import make_profile
    from moeplug.planner.stages import tokens_per_step

    assert tokens_per_step(0.0, 3) == 1.0 and tokens_per_step(1.0, 3) == 4.0
    assert tokens_per_step(0.5, 2) == pytest.approx(1.75)
    model = fixture_models["qwen3moe"]
    info = inspect_model(model)
    profile = make_profile(patched_build, model, tmp_path / "p.profile.gguf", 8)
    d = inspect_model(draft)
    room = d.total_bytes + kv_cache_bytes(d, 2048) + compute_buffer_bytes(d) + DEFAULT_COSTS.cuda_pool_headroom // 4
    budget = others(info, 2048) + room + info.expert_bytes // 3
    found = {}
    for n in (1, 3):
        plan = plan_with(info, 2048, budget, profile, spec=Speculation("draft", str(draft), n))
        notes = [x for x in plan.notes if x.startswith("speculation: a verification batch")]
        assert len(notes) == 1, plan.notes
        m = re.search(rf"batch of {n + 1} tokens is modelled at ([\d.]+)x .* above ([\d.]+) acceptance", notes[0])
        assert m, notes[0]
        found[n] = float(m[1]), float(m[2])
        assert 1.0 <= found[n][0] <= n + 1
        assert tokens_per_step(found[n][1], n) == pytest.approx(found[n][0], abs=0.06)
    assert found[3][0] > found[1][0] and found[3][1] >= found[1][1] - 0.01
    assert not [x for x in plan_with(info, 2048, budget, profile).notes if x.startswith("speculation")]
