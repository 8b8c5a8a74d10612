"""Recorded router decisions: the npz trace layout, prompt ranges, and the route replay file.

A trace holds, for every token of every prompt, the experts each MoE layer selected (and, where
the source has them, their routing weights). Two containers carry one:

- the npz layout of shared/data/traces/: `experts` uint8 [tokens, layers, used], `probs` float16
  [tokens, layers, used], `offsets` int64 [prompts + 1];
- the route replay file (native/REPLAY-FORMAT.md), the GGUF that llama.cpp's
  `--moe-route-replay` reads; this module writes it and checks it as the engine does.

Nothing here prints: errors are one TraceError naming the problem.

    from moeplug.profile.trace import load_trace, write_replay
    trace = load_trace("decode-routing-mmlu.npz").select("0:400")
    write_replay(trace, "train.replay.gguf")
    print(trace.counts()[0])          # layer 0: selections per expert
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeplug.core.errors import MoeplugError, about_file
from moeplug.core.fsutil import atomic_gguf

REPLAY_VERSION = 1
REPLAY_TYPE = "moe-route-replay"
GGUF_MAGIC = b"GGUF"
_RANGE_RE = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*$")


class TraceError(MoeplugError):
    """A trace or replay file that cannot be read, or a prompt range that selects nothing."""


@dataclass
class Trace:
    experts: np.ndarray  # int32 [n_tokens, n_layer, n_expert_used]
    offsets: np.ndarray  # int64 [n_prompts + 1]: prompt p is rows offsets[p]:offsets[p+1]
    n_expert: int
    weights: np.ndarray | None = None  # float32 [n_tokens, n_layer, n_expert_used]
    source: str = ""
    first_prompt: int = 0  # index of prompt 0 in the file it was selected from

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.experts.shape[1])

    @property
    def n_expert_used(self) -> int:
        return int(self.experts.shape[2])

    @property
    def n_prompts(self) -> int:
        return len(self.offsets) - 1

    def prompt_of_token(self) -> np.ndarray:
        """int32 [n_tokens]: the prompt index (in this trace) of every row."""
        return np.repeat(np.arange(self.n_prompts, dtype=np.int32), np.diff(self.offsets))

    def position_of_token(self) -> np.ndarray:
        """int32 [n_tokens]: each row's position within its prompt."""
        return (np.arange(self.n_tokens, dtype=np.int64) - np.repeat(self.offsets[:-1], np.diff(self.offsets))
                ).astype(np.int32)

    def select(self, spec: str | None) -> Trace:
        """The prompts of a python-slice range 'A:B' (':B', 'A:', negatives count from the end; 'N' is
        one prompt); None or '' keeps them all."""
        if not spec:
            return self
        start, stop = parse_prompt_range(spec, self.n_prompts)
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Trace(experts=self.experts[lo:hi], offsets=self.offsets[start:stop + 1] - lo, n_expert=self.n_expert,
                     weights=None if self.weights is None else self.weights[lo:hi],
                     source=f"{self.source} prompts {self.first_prompt + start}:{self.first_prompt + stop}",
                     first_prompt=self.first_prompt + start)

    def counts(self) -> np.ndarray:
        """int64 [n_layer, n_expert]: how often each expert of each layer was selected."""
        flat = (self.experts.astype(np.int64) + np.arange(self.n_layer, dtype=np.int64)[None, :, None] * self.n_expert)
        return np.bincount(flat.ravel(), minlength=self.n_layer * self.n_expert).reshape(self.n_layer, self.n_expert)

    def top_share(self, n: int) -> np.ndarray:
        """float [n_layer]: the share of each layer's selections its n most selected experts take
        (the best a static n-slot set chosen in hindsight serves)."""
        counts = self.counts()
        ranked = -np.sort(-counts, axis=1)
        return ranked[:, :n].sum(axis=1) / np.maximum(1, counts.sum(axis=1))

    def summary(self) -> dict[str, Any]:
        lengths = np.diff(self.offsets)
        return {"source": self.source, "n_prompts": self.n_prompts, "n_tokens": self.n_tokens,
                "n_layer": self.n_layer, "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
                "weights": self.weights is not None,
                "prompt_tokens": {"min": int(lengths.min()), "median": float(np.median(lengths)),
                                  "max": int(lengths.max())}}


def parse_prompt_range(spec: str, n_prompts: int) -> tuple[int, int]:
    """(start, stop) of 'A:B' against n prompts, python-slice style; a one-line error when the
    range is not one or selects no prompt."""
    text = spec.strip()
    if re.fullmatch(r"-?\d+", text):
        i = int(text)
        start = i + n_prompts if i < 0 else i
        if not 0 <= start < n_prompts:
            raise TraceError(f"--prompts {spec}: no prompt {i} (the trace has {n_prompts} prompts, 0..{n_prompts - 1})")
        return start, start + 1
    m = _RANGE_RE.match(text)
    if not m:
        raise TraceError(f"--prompts {spec!r}: expected a range A:B of prompt indices (e.g. 0:400, 400:, -100:)")
    start, stop, _ = slice(int(m[1]) if m[1] else None, int(m[2]) if m[2] else None).indices(n_prompts)
    if stop <= start:
        raise TraceError(f"--prompts {spec}: selects no prompts (the trace has {n_prompts} prompts, 0..{n_prompts - 1})")
    return start, stop


def _check_layout(experts: np.ndarray, offsets: np.ndarray, n_expert: int, weights: np.ndarray | None) -> None:
    """The checks the engine makes: shapes, offsets from 0 strictly increasing to n_tokens, ids in range."""
    if experts.ndim != 3 or 0 in experts.shape[1:]:
        raise TraceError(f"experts has shape {list(experts.shape)}, expected [tokens, layers, used]")
    if weights is not None and weights.shape != experts.shape:
        raise TraceError(f"weights have shape {list(weights.shape)}, the experts {list(experts.shape)}")
    if offsets.ndim != 1 or len(offsets) < 2:
        raise TraceError(f"offsets has shape {list(offsets.shape)}, expected [prompts + 1] with at least one prompt")
    if offsets[0] != 0:
        raise TraceError(f"offsets[0] is {offsets[0]}, expected 0")
    steps = np.diff(offsets)
    if (steps <= 0).any():
        p = int(np.argmax(steps <= 0))
        raise TraceError(f"offsets are not strictly increasing: prompt {p} spans {offsets[p]}..{offsets[p + 1]}")
    if offsets[-1] != len(experts):
        raise TraceError(f"offsets end at {offsets[-1]} but there are {len(experts)} tokens")
    if n_expert < 1:
        raise TraceError(f"n_expert is {n_expert}")
    if len(experts) and (experts.min() < 0 or experts.max() >= n_expert):
        bad = experts.min() if experts.min() < 0 else experts.max()
        raise TraceError(f"expert id {bad} is out of range for {n_expert} experts")


def read_npz(path: str | Path, n_expert: int | None = None) -> Trace:
    """The npz trace layout. n_expert: experts per layer of the recorded model (the npz does not
    say; default: the highest id seen + 1)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("experts", "offsets") if k not in data.files]
            if missing:
                raise TraceError(f"not a routing trace: no {' or '.join(missing)} array (has: "
                                 f"{', '.join(data.files) or 'nothing'})")
            experts, offsets = data["experts"], data["offsets"]
            probs = data["probs"] if "probs" in data.files else None
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    except Exception as exc:  # not a zip, a damaged member, a pickled object...
        raise TraceError(f"{path}: not a readable npz trace ({type(exc).__name__}: {exc})") from None
    for name, arr, kinds in (("experts", experts, "iu"), ("offsets", offsets, "iu"), ("probs", probs, "f")):
        if arr is not None and arr.dtype.kind not in kinds:
            raise TraceError(f"{path}: {name} has dtype {arr.dtype}, expected {'integers' if kinds == 'iu' else 'floats'}")
    experts = experts.astype(np.int32)
    offsets = offsets.astype(np.int64)
    if n_expert is None:
        n_expert = int(experts.max()) + 1 if experts.size else 0
    weights = probs.astype(np.float32) if probs is not None else None
    with about_file(path, TraceError, "npz trace"):
        _check_layout(experts, offsets, n_expert, weights)
    return Trace(experts=experts, offsets=offsets, n_expert=n_expert, weights=weights, source=path.name)


def write_replay(trace: Trace, path: str | Path, weights: bool = True) -> Path:
    """The route replay file of native/REPLAY-FORMAT.md, written atomically. weights: write
    replay.weights when the trace has them."""
    path = Path(path)
    if trace.n_tokens >= 2**31:
        raise TraceError(f"{trace.n_tokens} tokens do not fit the replay file's I32 offsets")
    with atomic_gguf(path, REPLAY_TYPE) as w:
        w.add_string("general.type", REPLAY_TYPE)
        w.add_uint32("moe_replay.version", REPLAY_VERSION)
        w.add_uint32("moe_replay.n_layer", trace.n_layer)
        w.add_uint32("moe_replay.n_expert", trace.n_expert)
        w.add_uint32("moe_replay.n_expert_used", trace.n_expert_used)
        w.add_uint32("moe_replay.n_prompts", trace.n_prompts)
        w.add_uint32("moe_replay.n_tokens", trace.n_tokens)
        w.add_string("moe_replay.source", trace.source)
        w.add_tensor("replay.experts", np.ascontiguousarray(trace.experts, dtype=np.int32))
        if weights and trace.weights is not None:
            w.add_tensor("replay.weights", np.ascontiguousarray(trace.weights, dtype=np.float32))
        w.add_tensor("replay.offsets", np.ascontiguousarray(trace.offsets, dtype=np.int32))
    return path


def _u32(reader: Any, key: str) -> int:
    from gguf import GGUFValueType

    f = reader.get_field(key)
    if f is None:
        raise TraceError(f"missing key {key}")
    if f.types != [GGUFValueType.UINT32]:
        raise TraceError(f"{key} is {'/'.join(t.name for t in f.types)}, expected UINT32")
    return int(f.contents())


def read_replay(path: str | Path) -> Trace:
    """Read a route replay file and check it as the engine does (type, version, key types,
    tensor types and shapes, offsets, ids in range)."""
    from moeplug.model.inspect import open_gguf

    path = Path(path)
    reader = open_gguf(path, "replay file", TraceError)
    with about_file(path, TraceError, "replay file"):
        return _parse_replay(reader, path)


def _parse_replay(reader: Any, path: Path) -> Trace:
    from gguf import GGMLQuantizationType as QT

    kind = reader.get_field("general.type")
    if kind is None or kind.contents() != REPLAY_TYPE:
        raise TraceError(f"not a route replay file (general.type is not '{REPLAY_TYPE}')")
    version = _u32(reader, "moe_replay.version")
    if version != REPLAY_VERSION:
        raise TraceError(f"unsupported replay version {version} (this moeplug reads version {REPLAY_VERSION})")
    n_layer, n_expert, n_used, n_prompts, n_tokens = (
        _u32(reader, f"moe_replay.{k}") for k in ("n_layer", "n_expert", "n_expert_used", "n_prompts", "n_tokens"))
    src = reader.get_field("moe_replay.source")
    tensors = {t.name: t for t in reader.tensors}

    def tensor(name: str, qtype: QT, ne: list[int], required: bool = True) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            if required:
                raise TraceError(f"no tensor {name}")
            return None
        if t.tensor_type != qtype:
            raise TraceError(f"{name} is {t.tensor_type.name}, expected {qtype.name}")
        if [int(x) for x in t.shape] != ne:
            raise TraceError(f"{name} has ne {[int(x) for x in t.shape]}, expected {ne} from the keys")
        return np.asarray(t.data)

    experts = tensor("replay.experts", QT.I32, [n_used, n_layer, n_tokens])
    weights = tensor("replay.weights", QT.F32, [n_used, n_layer, n_tokens], required=False)
    offsets = tensor("replay.offsets", QT.I32, [n_prompts + 1])
    assert experts is not None and offsets is not None
    experts = experts.reshape(n_tokens, n_layer, n_used).astype(np.int32)
    w = None if weights is None else weights.reshape(n_tokens, n_layer, n_used).astype(np.float32)
    offs = offsets.astype(np.int64)
    _check_layout(experts, offs, n_expert, w)
    return Trace(experts=experts, offsets=offs, n_expert=n_expert, weights=w,
                 source=str(src.contents()) if src is not None else path.name)


def load_trace(path: str | Path, n_expert: int | None = None) -> Trace:
    """A trace from either container, told apart by the file's first bytes (a GGUF, or an npz zip).
    n_expert applies to an npz only (a replay file states it)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return read_replay(path)
    if magic.startswith(b"PK"):
        return read_npz(path, n_expert)
    raise TraceError(f"{path}: neither an npz trace nor a route replay file")
