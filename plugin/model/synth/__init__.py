"""Synthetic random-weight MoE models that stock llama.cpp loads.

    from moeplug.model.synth import ModelSpec, make_model
    make_model(ModelSpec(arch="qwen3moe", dtype="q8_0"), "tiny.gguf")

Same spec and seed -> byte-identical files.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeplug.model.synth.archs import ARCHS, DTYPES, ModelPlan, ModelSpec, TensorPlan, plan_model
from moeplug.model.synth.vocab import Vocab, add_vocab_to_writer, builtin_vocab, vocab_from_gguf
from moeplug.model.synth.weights import tensor_data

__all__ = ["ARCHS", "DTYPES", "SHAPES", "ModelSpec", "ModelPlan", "TensorPlan", "make_model", "plan_for",
           "benchmark_spec", "header_writer", "shape_spec"]

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def benchmark_spec(seed: int = 1234) -> ModelSpec:
    """The GPU benchmark shape: Qwen3-30B-A3B (48 layers, 128 experts, 8 used), Q4_K, ~16 GiB."""
    return ModelSpec(
        arch="qwen3moe", layers=48, experts=128, used=8, embd=2048, expert_ff=768,
        heads=32, heads_kv=4, head_dim=128, dtype="q4_k", seed=seed, ctx=40960,
        dense_ff=6144, vocab_size=151936, name="moeplug-synthetic-qwen3-30b-a3b-shape-q4_k",
    )


def gpt_oss_20b_spec(seed: int = 1234) -> ModelSpec:
    """gpt-oss-20b's shape: 24 layers, 32 experts, 4 used, n_embd 2880, expert FF 2880, 64 query heads
    and 8 KV heads of 64, attention sinks, a 128-token sliding window on alternate layers, its
    201088-token vocabulary; the experts in MXFP4 as the model ships them, the other matrices F16
    (the convert script keeps the source's 16-bit weights; norms, router, biases and sinks F32)."""
    return ModelSpec(
        arch="gpt-oss", layers=24, experts=32, used=4, embd=2880, expert_ff=2880, heads=64, heads_kv=8,
        head_dim=64, dtype="f16", expert_dtype="mxfp4", seed=seed, ctx=131072, sliding_window=128,
        vocab_size=201088, name="moeplug-synthetic-gpt-oss-20b-shape-mxfp4",
    )


# model shapes of `moeplug dev make-model --shape NAME`
SHAPES: dict[str, Callable[[int], ModelSpec]] = {"qwen3-30b-a3b": benchmark_spec, "gpt-oss-20b": gpt_oss_20b_spec}


def shape_spec(name: str, seed: int = 1234) -> ModelSpec:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name](seed)


def load_vocab(spec: ModelSpec, vocab_path: str | Path | None) -> Vocab:
    if vocab_path is not None:
        return vocab_from_gguf(Path(vocab_path))
    return builtin_vocab(spec.vocab_size)


def plan_for(spec: ModelSpec, vocab_path: str | Path | None = None) -> tuple[ModelPlan, Vocab]:
    vocab = load_vocab(spec, vocab_path)
    return plan_model(spec, len(vocab)), vocab


def header_writer(spec: ModelSpec, plan: ModelPlan, vocab: Vocab, path: Path, split_max_tensors: int = 0) -> Any:
    """A gguf.GGUFWriter at `path` holding the model's metadata, vocabulary and tensor table (the
    tensors' data not yet written): what make_model writes first."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, spec.arch, split_max_tensors=split_max_tensors)
    for key, value, vtype in plan.metadata:
        writer.add_key_value(key, value, vtype)
    add_vocab_to_writer(writer, vocab)
    for t in plan.tensors:
        np_dtype = np.float16 if t.qtype == gguf.GGMLQuantizationType.F16 else np.float32
        writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np_dtype), t.n_bytes, raw_dtype=t.qtype)
    return writer


def make_model(
    spec: ModelSpec,
    out: str | Path,
    *,
    shards: int = 1,
    vocab_path: str | Path | None = None,
    progress: ProgressFn | None = None,
) -> list[Path]:
    """Write the model to `out` (or `out`'s stem + -0000i-of-0000N.gguf shards); return the files.

    Files appear only once completely written: they are written in a temporary folder beside
    `out` and renamed into place.
    """
    out = Path(out)
    if shards < 1:
        raise ValueError("--shards must be at least 1")
    plan, vocab = plan_for(spec, vocab_path)
    if shards > len(plan.tensors):
        raise ValueError(f"--shards {shards} is more than the model's {len(plan.tensors)} tensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        per_shard = math.ceil(len(plan.tensors) / shards) if shards > 1 else 0
        writer = header_writer(spec, plan, vocab, tmp_dir / out.name, per_shard)
        written_names = [p.name for p in writer.format_shard_names(tmp_dir / out.name)]
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total, done = sum(t.n_bytes for t in plan.tensors), 0
        for index, t in enumerate(plan.tensors):
            writer.write_tensor_data(tensor_data(t, spec.seed, index))
            done += t.n_bytes
            if progress:
                progress(done, total)
        writer.close()
        final = []
        for name in written_names:
            os.replace(tmp_dir / name, out.parent / name)
            final.append(out.parent / name)
        return final
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
