"""`moeplug inspect` against real GGUF files written by the generator and by gguf directly."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from helpers import fixture_spec, run_cli
from moeplug.core.errors import GGUFError, MoeplugError, NotApplicableError
from moeplug.model.inspect import inspect_model
from moeplug.model.synth import ARCHS, DTYPES, make_model, plan_for

EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias|scale)$")


def expected_bytes(arch: str, dtype: str) -> dict:
    """Bytes computed from the generator's plan (shapes and types) and gguf's block sizes alone."""
    plan, _ = plan_for(fixture_spec(arch, dtype))
    per_layer: dict[int, int] = {}
    per_expert: dict[int, int] = {}
    total = expert_total = 0
    for t in plan.tensors:
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        nbytes = math.prod(t.ne) // block * type_size
        total += nbytes
        m = EXPERT_RE.match(t.name)
        if m:
            b = int(m[1])
            per_layer[b] = per_layer.get(b, 0) + nbytes
            per_expert[b] = per_expert.get(b, 0) + nbytes // t.ne[-1]
            expert_total += nbytes
    return {"per_layer": per_layer, "per_expert": per_expert, "total": total, "experts": expert_total}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_matches_independent_byte_count(tmp_path: Path, arch: str, dtype: str) -> None:
    path = make_model(fixture_spec(arch, dtype), tmp_path / "m.gguf")[0]
    doc = inspect_model(path).to_json()
    want = expected_bytes(arch, dtype)
    assert doc["arch"] == arch
    assert doc["n_expert"] == 8 and doc["n_expert_used"] == 2 and doc["n_layer"] == 3
    assert doc["moe_layers"] == sorted(want["per_layer"])
    assert doc["bytes_per_expert"] == {str(b): v for b, v in want["per_expert"].items()}
    assert doc["expert_bytes"] == want["experts"]
    assert doc["total_bytes"] == want["total"]
    assert doc["non_expert_bytes"] == want["total"] - want["experts"]
    # the file holds exactly those bytes plus header and alignment padding
    assert want["total"] < path.stat().st_size < want["total"] + 64 * 1024 + 32 * 200
    if dtype == "q4_k":
        assert set(doc["expert_quant_types"]) == {"Q4_K"} | ({"F32"} if arch == "gpt-oss" else set())


def test_family_specific_layout(fixture_models: dict[str, Path]) -> None:
    hy = inspect_model(fixture_models["hy_v3"])
    assert hy.moe_layers == [1, 2]  # block 0 is a leading dense block
    assert set(hy.layers[0].tensors) == {"ffn_gate_up_exps.weight", "ffn_down_exps.weight"}
    assert hy.n_expert_shared == 1
    oss = inspect_model(fixture_models["gpt-oss"])
    assert {"ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"} <= set(oss.layers[0].tensors)
    mtp = inspect_model(fixture_models["hy_v3-mtp"])
    assert mtp.n_layer == 4 and mtp.moe_layers == [1, 2, 3]  # the MTP block has experts of its own
    assert mtp.layers[-1].bytes_per_expert == hy.layers[0].bytes_per_expert
    qwen = inspect_model(fixture_models["qwen3moe"])
    assert set(qwen.layers[0].tensors) == {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}


def test_per_expert_scales_are_expert_bytes(tmp_path: Path) -> None:
    from dataclasses import replace

    spec = replace(fixture_spec("qwen3moe"), expert_scales=True)
    info = inspect_model(make_model(spec, tmp_path / "s.gguf")[0])
    layer = info.layers[0]
    assert layer.tensors["ffn_up_exps.scale"].n_bytes == 8 * 4
    base = inspect_model(make_model(fixture_spec("qwen3moe"), tmp_path / "b.gguf")[0])
    assert layer.bytes_per_expert == base.layers[0].bytes_per_expert + 3 * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_split_equals_unsplit(tmp_path: Path, arch: str) -> None:
    single = make_model(fixture_spec(arch), tmp_path / "one" / "m.gguf")
    shards = make_model(fixture_spec(arch), tmp_path / "split" / "m.gguf", shards=3)
    assert [p.name for p in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    a, b = inspect_model(single[0]).to_json(), inspect_model(shards[1]).to_json()  # any shard works
    for doc in (a, b):
        doc.pop("path")
        doc.pop("shards")
    assert a == b


def test_missing_shard_is_an_error(tmp_path: Path) -> None:
    shards = make_model(fixture_spec("qwen3moe"), tmp_path / "m.gguf", shards=3)
    shards[2].unlink()
    with pytest.raises(GGUFError, match="missing shard m-00003-of-00003.gguf"):
        inspect_model(shards[0])
    r = run_cli("inspect", str(shards[0]))
    assert r.returncode == 1
    assert "missing shard" in r.stderr and "Traceback" not in r.stderr


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    for arch in ARCHS:
        a = make_model(fixture_spec(arch, "q4_k", seed=3), tmp_path / f"{arch}-a.gguf")[0].read_bytes()
        b = make_model(fixture_spec(arch, "q4_k", seed=3), tmp_path / f"{arch}-b.gguf")[0].read_bytes()
        c = make_model(fixture_spec(arch, "q4_k", seed=4), tmp_path / f"{arch}-c.gguf")[0].read_bytes()
        assert a == b
        assert a != c


def test_weights_have_the_planned_scale(tmp_path: Path) -> None:
    """Dequantized random blocks: zero mean, std 1/sqrt(fan_in), finite."""
    path = make_model(fixture_spec("qwen3moe", "q4_k"), tmp_path / "m.gguf")[0]
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.isfinite(w).all()
    assert abs(float(w.mean())) < 0.01
    assert float(w.std()) == pytest.approx(1 / math.sqrt(256), rel=0.1)


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[int, ...]], kv: dict[str, int]) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for k, v in kv.items():
        w.add_uint32(k, v)
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_dense_model_is_not_applicable(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "dense.gguf", "qwen3",
                       {"token_embd.weight": (32, 16), "blk.0.ffn_up.weight": (64, 16)}, {"qwen3.block_count": 1})
    with pytest.raises(NotApplicableError, match="dense model"):
        inspect_model(path)
    r = run_cli("inspect", str(path))
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "dense model" in r.stderr


def test_unknown_architecture_with_expert_tensors(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "odd.gguf", "frobnicator-moe",
                       {"blk.0.ffn_up_exps.weight": (4, 8, 16)}, {"frobnicator-moe.expert_count": 4})
    with pytest.raises(MoeplugError, match="unknown architecture 'frobnicator-moe'.*expert tensors"):
        inspect_model(path)
    r = run_cli("inspect", "--json", str(path))
    assert r.returncode == 1 and "unknown architecture" in r.stderr and r.stdout == ""


@pytest.mark.parametrize("keep", [10, 200, 0.5])
def test_truncated_file(tmp_path: Path, fixture_models: dict[str, Path], keep: float) -> None:
    src = fixture_models["qwen3moe"]
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(GGUFError, match="truncated"):
        inspect_model(path)
    r = run_cli("inspect", str(path))
    assert r.returncode == 1 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights\n")
    r = run_cli("inspect", str(path))
    assert r.returncode == 1
    assert r.stderr.strip() == f"moeplug: error: {path}: not a GGUF file (magic b'thes', expected b'GGUF')"
    r = run_cli("inspect", str(tmp_path / "absent.gguf"))
    assert r.returncode == 1 and "no such file" in r.stderr


def test_cli_json_keys(fixture_models: dict[str, Path]) -> None:
    r = run_cli("inspect", "--json", str(fixture_models["gpt-oss"]))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in ("path", "arch", "n_layer", "n_expert", "n_expert_used", "moe_layers", "bytes_per_expert",
                "expert_bytes", "non_expert_bytes", "total_bytes"):
        assert key in doc
    assert doc["arch"] == "gpt-oss"


def test_cli_make_model_and_usage_errors(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    r = run_cli("dev", "make-model", "--arch", "hy_v3", "--layers", "3", "--experts", "8", "--used", "2",
                "--dtype", "q4_0", "--seed", "5", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files"] == [str(out)]
    assert inspect_model(out).arch == "hy_v3"
    r = run_cli("dev", "make-model", "--used", "9", "--experts", "8", "--out", str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and "--used 9 is larger than --experts 8" in r.stderr
    assert not (tmp_path / "x.gguf").exists()
    r = run_cli("dev", "make-model", "--dtype", "q3_k", "--out", str(tmp_path / "y.gguf"))
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert list(tmp_path.iterdir()) == [out]  # nothing half-written left behind


def test_benchmark_shape_plan() -> None:
    """The GPU benchmark model's plan: Qwen3-30B-A3B shape, ~16 GiB, 2,654,208 B per expert."""
    from moeplug.model.synth import benchmark_spec

    plan, vocab = plan_for(benchmark_spec())
    assert len(vocab) == 151936
    total = sum(t.n_bytes for t in plan.tensors)
    layer0 = [t for t in plan.tensors if t.name.startswith("blk.0.ffn_") and "_exps" in t.name]
    per_expert = sum(t.n_bytes // t.ne[-1] for t in layer0)
    assert per_expert == 2_654_208
    assert 15.5 * 2**30 < total < 16.5 * 2**30
