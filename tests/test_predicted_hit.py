"""The planner's predicted slot hit rate against the hit rate llama-server measures, on the profile's
own prompts replayed: the demo and a second architecture (gpt-oss), each profiled by moeplug's
profiler on the bundled prompt sets, planned as the demo is (a quarter of the experts, static), and
served with the plan's flags.

The prediction compared is the one a profile of counts alone gives (what a served model's live
recording holds): the share of the generated tokens' selections that the experts the engine puts in
the slots took, layer by layer (planner.allocate.hit_curves, ranked by slot_order as the engine fills
its slots). A profile with the prompts' sequences plans the same slots and predicts lower, on prompts
it was not ranked on (cross-validated). The server counts the batches that run the cache; with
`--moe-cache-max-batch 1` those are the generated tokens, the traffic the prediction is of."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import requests

from helpers import fixture_spec
from moeplug.model.inspect import inspect_model
from moeplug.model.demo import demo_spec
from moeplug.model.synth import make_model
from moeplug.operations.install import DEMO_PROFILE_TOKENS, demo_slots, plan_for
from moeplug.planner.allocate import served_share
from moeplug.planner.request import PlanRequest
from moeplug.profile.format import read_profile, write_profile
from moeplug.profile.runner import DEFAULT_PROMPT_SETS, ProfileRun, read_prompts, resolve_prompt_set, run_profile
from moeplug.serving.metrics import parse_cache_counters
from moeplug.serving.server import start_server


@pytest.mark.parametrize("arch", ["demo", "gpt-oss"])
def test_predicted_hit_rate_is_what_the_server_measures_on_the_profiles_prompts(patched_build, home, tmp_path: Path,
                                                                                 arch: str) -> None:
    model = make_model(demo_spec() if arch == "demo" else fixture_spec(arch), tmp_path / f"{arch}.gguf")[0]
    run = ProfileRun(tool=patched_build.binary("llama-moe-profile"), model=model, n_predict=DEMO_PROFILE_TOKENS,
                     ctx=2048, threads=2)
    profile_path, profile = run_profile(run, list(DEFAULT_PROMPT_SETS), tmp_path / "profile.gguf")
    # the same counts, as a live recording holds them: one source without sequences
    live = replace(profile.sources[0], label="live", prompt_labels=[], seq=profile.sources[0].seq[:0],
                   meta=profile.sources[0].meta[:0])
    counts_path = write_profile(replace(profile, sources=[live]), tmp_path / "counts.gguf")

    info = inspect_model(model)
    request = PlanRequest(2048, slots_in_ram=demo_slots(info, True), policy="static")
    plan = plan_for(info, request, counts_path)
    ranked = plan_for(info, request, profile_path)
    assert plan.slots_per_layer == ranked.slots_per_layer and 0 < plan.slots_per_layer[0] < info.n_expert
    assert ranked.predicted_hit_rate < plan.predicted_hit_rate  # held out: its prompts were not ranked on

    args = [*plan.server_args, "--metrics", "--moe-cache-max-batch", "1"]
    with start_server(patched_build.binary("llama-server"), model, tmp_path / "server.log", extra_args=args, ctx=None,
                      threads=2) as srv:
        srv.wait_healthy(timeout=120)
        for prompt_set in DEFAULT_PROMPT_SETS:  # as the profiler ran them: greedy, to the end of text or n
            for prompt in read_prompts(resolve_prompt_set(prompt_set)[1]):
                srv.complete(prompt, n_predict=DEMO_PROFILE_TOKENS)
        counters = parse_cache_counters(requests.get(f"{srv.url}/metrics", timeout=10).text)
    assert counters is not None and counters.selections > 0.9 * profile.counts_decode.sum()
    measured = counters.hits / counters.selections
    assert measured == pytest.approx(plan.predicted_hit_rate, abs=0.01), (measured, plan.predicted_hit_rate)
    # layer by layer, the same slots: the planner's share of the profile's generated tokens beside the server's
    shares = served_share(read_profile(counts_path), plan.slots_per_layer, profile.counts_decode)
    assert len(counters.layers) == len(shares)
    for layer, share in zip((counters.layers[il] for il in sorted(counters.layers)), shares):
        assert layer["hits"] / layer["selections"] == pytest.approx(share, abs=0.03), (counters.layers, shares)
