"""A profile made of recorded router decisions (a trace) instead of a profiler run.

The profile carries the model's fingerprint, so the planner and llama-server's
`--moe-cache-profile` take it as that model's own, and the trace's routing:

- `counts.decode`: the trace's selections per layer and expert (a trace records generated
  tokens; the real gpt-oss-20b one has no prompt routing);
- `counts.prefill`: zeros, as nothing of the prompts was recorded (the engine orders experts by
  decode counts, prefill only breaks ties; the planner reads decode counts first);
- one source, `seq.0`/`seq_meta.0`: every token's selections with its prompt and position, phase
  decode, so that `profile analyze` and the planner's hit curves (which split by prompt, see
  allocate.hit_curves) see the same prompts and order the trace has.

A model's MTP (NextN) blocks are not in a trace (the replay leaves them to their router): their
rows are zero counts and `-1` (not routed) ids.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from moeplug.profile.format import PHASE_DECODE, Profile, ProfileError, ProfileSource, model_fingerprint
from moeplug.profile.trace import Trace, load_trace

_DOWN_RE = re.compile(r"^blk\.(\d+)\.ffn_down_(?:ch)?exps\.weight$")


def _down_tensors(expert_tensors: tuple[str, ...]) -> list[str]:
    """The expert down weights, one per MoE block, in block order (the profiler's rows)."""
    found = [(int(m[1]), name) for name in expert_tensors if (m := _DOWN_RE.match(name))]
    return [name for _, name in sorted(found)]


def _nextn_blocks(model: Path) -> int:
    import gguf

    from moeplug.model.inspect import scalar_or_max, shard_paths

    reader = gguf.GGUFReader(shard_paths(model)[0])
    arch = str(reader.get_field("general.architecture").contents())
    f = reader.get_field(f"{arch}.nextn_predict_layers")
    return (scalar_or_max(f.contents()) or 0) if f is not None else 0


def profile_from_trace(trace: Trace, model: str | Path, label: str | None = None) -> Profile:
    """The profile of `model` whose routing is the trace's; refuses a model whose MoE layers,
    experts or experts per token differ from the trace's, naming what differs."""
    model = Path(model)
    fp = model_fingerprint(model)
    tensors = _down_tensors(fp.expert_tensors)
    n_mtp = _nextn_blocks(model)
    trunk = [t for t in tensors if int(t.split(".")[1]) < fp.n_layer - n_mtp] if n_mtp else tensors
    diffs = [f"{what} {mine} vs {theirs}" for what, mine, theirs in (
        ("MoE layers", len(trunk), trace.n_layer), ("experts", fp.n_expert, trace.n_expert),
        ("experts per token", fp.n_expert_used, trace.n_expert_used)) if mine != theirs]
    if diffs:
        raise ProfileError(f"the trace does not fit {model.name}: {', '.join(diffs)} (model vs trace) differ")
    n_rows = len(tensors)
    seq = np.full((trace.n_tokens, n_rows, trace.n_expert_used), -1, dtype=np.int16)
    seq[:, :trace.n_layer] = trace.experts
    meta = np.stack([trace.prompt_of_token(), trace.position_of_token(),
                     np.full(trace.n_tokens, PHASE_DECODE, np.int32)], axis=1).astype(np.int32)
    counts = np.zeros((n_rows, fp.n_expert), dtype=np.int64)
    counts[:trace.n_layer] = trace.counts()
    source = ProfileSource(label=label or f"trace {trace.source}",
                           prompt_labels=[f"trace prompt {trace.first_prompt + p}" for p in range(trace.n_prompts)],
                           seq=seq, meta=meta)
    return Profile(fingerprint=fp, tensors=tensors, counts_prefill=np.zeros_like(counts), counts_decode=counts,
                   sources=[source])


def profile_from_trace_file(path: str | Path, model: str | Path, prompts: str | None = None,
                            n_expert: int | None = None) -> Profile:
    """profile_from_trace of an npz trace or a replay file, for a prompt range 'A:B'."""
    return profile_from_trace(load_trace(path, n_expert).select(prompts), model)
