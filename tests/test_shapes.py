"""`moeplug dev make-model --shape`: real models' shapes, and gpt-oss's experts in MXFP4."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from helpers import run_cli
from moeplug.commands.main import build_parser
from moeplug.model.inspect import inspect_model
from moeplug.model.synth import ModelSpec, make_model, plan_for, shape_spec


def test_gpt_oss_20b_shape_plan() -> None:
    """The full shape is planned, not written (13 GiB): gpt-oss-20b's layout and types."""
    spec = shape_spec("gpt-oss-20b")
    plan, vocab = plan_for(spec)
    md = {k: v for k, v, _ in plan.metadata}
    assert (md["gpt-oss.block_count"], md["gpt-oss.expert_count"], md["gpt-oss.expert_used_count"]) == (24, 32, 4)
    assert (md["gpt-oss.embedding_length"], md["gpt-oss.expert_feed_forward_length"]) == (2880, 2880)
    assert (md["gpt-oss.attention.head_count"], md["gpt-oss.attention.head_count_kv"],
            md["gpt-oss.attention.key_length"]) == (64, 8, 64)
    assert md["gpt-oss.attention.sliding_window"] == 128 and md["general.file_type"] == 38  # MOSTLY_MXFP4_MOE
    assert len(vocab) == 201088
    types = {t.name: t.qtype for t in plan.tensors}
    QT = gguf.GGMLQuantizationType
    for b in range(24):
        for part in ("gate", "up", "down"):
            assert types[f"blk.{b}.ffn_{part}_exps.weight"] == QT.MXFP4
            assert types[f"blk.{b}.ffn_{part}_exps.bias"] == QT.F32
        assert types[f"blk.{b}.attn_sinks.weight"] == types[f"blk.{b}.ffn_gate_inp.weight"] == QT.F32
        assert types[f"blk.{b}.attn_q.weight"] == QT.F16
    expert_bytes = sum(t.n_bytes for t in plan.tensors if t.name.endswith("_exps.weight"))
    assert expert_bytes == 24 * 32 * 3 * 2880 * 2880 // 32 * 17


def test_shape_flags() -> None:
    parse = build_parser().parse_args
    assert parse(["dev", "make-model", "--out", "x", "--benchmark-shape"]).shape == "qwen3-30b-a3b"
    assert parse(["dev", "make-model", "--out", "x", "--shape", "gpt-oss-20b"]).shape == "gpt-oss-20b"
    assert shape_spec("qwen3-30b-a3b").layers == 48 and shape_spec("qwen3-30b-a3b").dtype == "q4_k"
    r = run_cli("dev", "make-model", "--out", "x.gguf", "--shape", "llama-70b")
    assert r.returncode == 2 and "invalid choice" in r.stderr and r.stderr.count("\n") == 1


TINY_MXFP4 = dict(arch="gpt-oss", layers=24, experts=32, used=4, embd=64, expert_ff=64, heads=4, heads_kv=2,
                  head_dim=16, dtype="f16", expert_dtype="mxfp4", seed=3)


def test_mxfp4_blocks_dequantize_to_the_planned_scale(tmp_path: Path) -> None:
    model = make_model(ModelSpec(**TINY_MXFP4), tmp_path / "mx.gguf")[0]
    reader = gguf.GGUFReader(model)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert np.isfinite(w).all() and abs(float(w.mean())) < 0.01
    # the scale is a power of two: the std is the planned 1/sqrt(fan_in) within a factor sqrt(2)
    assert 1 / math.sqrt(2) < float(w.std()) * math.sqrt(64) < math.sqrt(2)
    info = inspect_model(model)
    assert set(info.quant_bytes(experts_only=True)) == {"MXFP4", "F32"}  # the expert matrices and their biases


@pytest.mark.native
def test_mxfp4_gpt_oss_serves_on_the_cpu_build(patched_build, tmp_path: Path) -> None:
    """A tiny-width gpt-oss model of the real layout, experts in MXFP4: the patched llama-server
    loads it and completes."""
    from moeplug.serving.server import start_server

    model = make_model(ModelSpec(**TINY_MXFP4), tmp_path / "mx.gguf")[0]
    log = tmp_path / "server.log"
    with start_server(patched_build.binary("llama-server"), model, log, ctx=512, threads=2) as srv:
        srv.wait_healthy(timeout=120)
        reply = srv.complete("The quick brown fox", n_predict=8, ignore_eos=True)
    text = log.read_text(errors="replace")
    assert len(reply["tokens"]) == 8 and reply["timings"]["predicted_n"] == 8, reply
    assert "mxfp4" in text.lower(), text[-2000:]  # the loader's type summary names the experts' type
