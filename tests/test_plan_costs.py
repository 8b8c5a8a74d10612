"""The planner on the user's machine: a calibration's costs move the plan the way the bus says.

Two hand-written calibration files, the same CPU, a bus of 55 GB/s (the GPU machine's) and 6 GB/s (a
narrow link): the gpt-oss-20b shape at 7 GiB (a quarter of its experts' bytes) with a profile. On the
fast bus the GPU computes a share of the misses and the slots follow the prompt with eight uploads a
batch; on the slow one no byte of a miss crosses the bus (no share), the slots stay as profiled, and
what the plan models costs more. No native build: header-only models (test_golden_plans).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeplug.core.sizes import GIB
from moeplug.model.inspect import inspect_model
from moeplug.operations.calibrate import cost_model, read_calibration
from moeplug.planner.costs import DEFAULT_COSTS, CostModel
from moeplug.planner.plan import make_plan
from moeplug.planner.request import MachineFacts, PlanRequest
from test_golden_plans import MODELS, write_header_only, write_profile_for

CPU = 40e9  # a desktop's dual-channel DDR5, about


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gptoss")
    spec, n_trunk = MODELS["gptoss"]
    model = write_header_only(spec, root / "gptoss.gguf")
    return model, write_profile_for(model, n_trunk, root / "gptoss.moeprof", salt=6)


def calibration_file(path: Path, bus: float) -> Path:
    path.write_text(json.dumps({"cpu_expert_bytes_per_s": CPU, "h2d_bytes_per_s": bus}))
    return path


def plan_at(gpt_oss: tuple[Path, Path], costs: CostModel):
    model, profile = gpt_oss
    return make_plan(inspect_model(model), PlanRequest(4096, 7 * GIB),
                     MachineFacts(ram_available=64 * GIB, cpu_cores=16, costs=costs), profile_path=profile)


def test_a_slower_bus_moves_the_plan_off_the_bus(gpt_oss, tmp_path: Path) -> None:
    fast_file, slow_file = calibration_file(tmp_path / "fast.json", 55e9), calibration_file(tmp_path / "slow.json", 6e9)
    fast = plan_at(gpt_oss, cost_model(read_calibration(fast_file), str(fast_file)))
    slow = plan_at(gpt_oss, cost_model(read_calibration(slow_file), str(slow_file)))

    assert fast.stream_share > 0 and "--moe-cache-stream" in fast.server_args
    assert fast.cache_policy == "dynamic"
    uploads = fast.server_args[fast.server_args.index("--moe-cache-uploads") + 1]
    assert uploads == "8"

    # the slow bus: no share of the misses crosses it, and no slot is swapped over it
    assert slow.stream_share == 0 and "--moe-cache-stream" not in slow.server_args
    assert slow.cache_policy == "static" and "--moe-cache-uploads" not in slow.server_args
    assert slow.modelled_host_ms > fast.modelled_host_ms
    assert slow.modelled_prompt_us > fast.modelled_prompt_us  # prompt batches upload over the slow bus

    # each plan says what it was planned with
    assert fast.cost_model["h2d_bytes_per_s"] == 55e9 and slow.cost_model["h2d_bytes_per_s"] == 6e9
    assert str(slow_file) in slow.cost_model["source"] and slow.cost_model["cpu_expert_bytes_per_s"] == CPU


def test_the_bus_in_between_streams_less_and_uploads_fewer(gpt_oss) -> None:
    """25 GB/s (PCIe 4 x16): a smaller share than at 55, fewer uploads a batch."""
    fast = plan_at(gpt_oss, CostModel.from_measured(CPU, 55e9))
    middle = plan_at(gpt_oss, CostModel.from_measured(CPU, 25e9))
    assert 0 < middle.stream_share < fast.stream_share
    args = middle.server_args
    assert 1 <= int(args[args.index("--moe-cache-uploads") + 1]) < 8


def test_the_default_plan_records_no_cost_model(gpt_oss) -> None:
    plan = plan_at(gpt_oss, DEFAULT_COSTS)
    assert plan.cost_model is None and "cost_model" not in plan.to_json()


def test_measured_figures_map_onto_the_cost_model() -> None:
    """What a calibration measured replaces the GPU machine's figure; what it did not keeps it; the
    bus scales the uploads and the GPU's streamed misses; stock's prompt path measured sets both paths."""
    same = CostModel.from_measured(DEFAULT_COSTS.cpu_expert_bytes_per_s, DEFAULT_COSTS.h2d_bytes_per_s)
    assert same.upload_bytes_per_s == pytest.approx(DEFAULT_COSTS.upload_bytes_per_s)
    assert same.stream_gpu_ratio == pytest.approx(DEFAULT_COSTS.stream_gpu_ratio)
    assert same.dynamic_uploads == DEFAULT_COSTS.dynamic_uploads
    half = CostModel.from_measured(30e9, DEFAULT_COSTS.h2d_bytes_per_s / 2, round_trip_s=90e-6)
    assert half.cpu_expert_bytes_per_s == 30e9 and half.round_trip_s == 90e-6
    assert half.upload_bytes_per_s == pytest.approx(DEFAULT_COSTS.upload_bytes_per_s / 2)
    assert half.long_prompt_upload_bytes_per_s == pytest.approx(DEFAULT_COSTS.long_prompt_upload_bytes_per_s / 2)
    assert half.slot_pass_s == DEFAULT_COSTS.slot_pass_s and half.dynamic_uploads == 4
    stock_path = CostModel.from_measured(30e9, prompt_upload_bytes_per_s=24e9)
    assert stock_path.stock_upload_bytes_per_s == 24e9
    assert stock_path.upload_bytes_per_s == pytest.approx(24e9 * DEFAULT_COSTS.upload_bytes_per_s
                                                          / DEFAULT_COSTS.stock_upload_bytes_per_s)
    assert CostModel.from_json(half.to_json()) == half


def test_plan_takes_a_calibration_file_and_says_what_it_planned_with(gpt_oss, tmp_path: Path) -> None:
    """`moeplug plan MODEL --calibration FILE`: the file's costs in the plan and named in its table;
    a damaged file is one line and exit 1."""
    from helpers import one_line_error, run_cli

    model, profile = gpt_oss
    slow = calibration_file(tmp_path / "slow.json", 6e9)
    args = ["plan", str(model), "--vram-budget", "7GiB", "--profile", str(profile)]
    doc = json.loads(run_cli(*args, "--calibration", str(slow), "--json").stdout)
    assert doc["stream_share"] == 0 and doc["cost_model"]["h2d_bytes_per_s"] == 6e9
    assert json.loads(run_cli(*args, "--json").stdout)["stream_share"] > 0  # the GPU machine's figures
    text = run_cli(*args, "--calibration", str(slow)).stdout
    assert "costs (CPU, bus)" in text and "bus 6 GB/s" in text and "slow.json" in text
    (tmp_path / "bad.json").write_text('{"cpu_expert_bytes_per_s": -1}')
    one_line_error(run_cli(*args, "--calibration", str(tmp_path / "bad.json")), 1, "bad.json", "cpu_expert_bytes_per_s")
