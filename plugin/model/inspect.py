"""Read a GGUF MoE model's header and tensor table: experts, layers and bytes.

Only metadata is touched: `gguf.GGUFReader` memory-maps the file and no weight is loaded.
Split models (`NAME-00001-of-0000N.gguf`) take their metadata from shard 1 and their tensors
from every shard.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeplug.model.archs import LLAMA_CPP_ARCHITECTURES
from moeplug.core.errors import GGUFError, MoeplugError, NotApplicableError, about_file

GGUF_MAGIC = b"GGUF"
SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Routed-expert tensors: gate, up, down or fused gate_up, plain (exps) or chunked (chexps),
# with their per-expert biases and scales.
EXPERT_TENSOR_RE = re.compile(
    r"^blk\.(?P<block>\d+)\.(?P<key>ffn_(?:gate_up|gate|up|down)_(?:exps|chexps)\.(?:weight|bias|scale))$"
)
SHARED_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(?:gate|up|down)_shexp\.weight$")


@dataclass
class TensorInfo:
    name: str
    qtype: str
    shape: tuple[int, ...]  # ggml ne[] order: ne[0] is the row length
    n_bytes: int
    shard: int


@dataclass
class MoeLayer:
    block: int
    n_expert: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # key e.g. "ffn_up_exps.weight"

    @property
    def expert_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert: every expert tensor of the layer, sliced along its expert axis."""
        return sum(t.n_bytes // t.shape[-1] for t in self.tensors.values())


@dataclass
class ModelInfo:
    path: Path
    shards: list[Path]
    arch: str
    name: str | None
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    expert_ff: int | None
    layers: list[MoeLayer]
    tensors: list[TensorInfo]
    metadata: dict[str, Any]

    @property
    def moe_layers(self) -> list[int]:
        return [layer.block for layer in self.layers]

    @property
    def expert_bytes(self) -> int:
        return sum(layer.expert_bytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def non_expert_bytes(self) -> int:
        return self.total_bytes - self.expert_bytes

    def quant_bytes(self, experts_only: bool = False) -> dict[str, int]:
        expert_names = {t.name for layer in self.layers for t in layer.tensors.values()}
        out: dict[str, int] = {}
        for t in self.tensors:
            if experts_only and t.name not in expert_names:
                continue
            out[t.qtype] = out.get(t.qtype, 0) + t.n_bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_json(self) -> dict[str, Any]:
        """The stable `moeplug inspect --json` document."""
        return {
            "path": str(self.path),
            "shards": [str(p) for p in self.shards],
            "arch": self.arch,
            "name": self.name,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "n_expert_shared": self.n_expert_shared,
            "expert_feed_forward_length": self.expert_ff,
            "moe_layers": self.moe_layers,
            "bytes_per_expert": {str(layer.block): layer.bytes_per_expert for layer in self.layers},
            "expert_bytes": self.expert_bytes,
            "non_expert_bytes": self.non_expert_bytes,
            "total_bytes": self.total_bytes,
            "quant_types": self.quant_bytes(),
            "expert_quant_types": self.quant_bytes(experts_only=True),
            "layers": [
                {
                    "block": layer.block,
                    "n_expert": layer.n_expert,
                    "bytes_per_expert": layer.bytes_per_expert,
                    "expert_bytes": layer.expert_bytes,
                    "tensors": {
                        key: {"type": t.qtype, "shape": list(t.shape), "bytes": t.n_bytes}
                        for key, t in sorted(layer.tensors.items())
                    },
                }
                for layer in self.layers
            ],
        }


def shard_names(name: str) -> list[str] | None:
    """The file names of every shard of the split model `name` (a shard's name), else None."""
    m = SHARD_RE.match(name)
    if not m:
        return None
    count = int(m["count"])
    return [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def shard_paths(path: Path) -> list[Path]:
    """All shards of a split model given any one of them (or [path] if it is not split)."""
    names = shard_names(path.name)
    if names is None:
        return [path]
    paths = [path.with_name(n) for n in names]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise GGUFError(f"{path}: split model is incomplete: missing shard {', '.join(missing)}")
    return paths


# GGUF value types with a fixed size (gguf.h); 8 is a string, 9 an array
GGUF_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGML_MAX_DIMS = 4


def header_problem(path: Path) -> str | None:
    """What makes the GGUF header impossible, or None: every count, length, type code and tensor
    rank checked against the bytes that are left, before a reader allocates or loops by them (a
    hostile count of 2**32 strings would otherwise keep it busy for minutes)."""
    import mmap
    import struct

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return f"{size} bytes, shorter than a GGUF header"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            pos = 0

            def take(fmt: str, what: str) -> int:
                nonlocal pos
                n = struct.calcsize(fmt)
                if pos + n > size:
                    raise _HeaderEnd(f"{what} at byte {pos} runs past the end of the file")
                (v,) = struct.unpack_from(fmt, buf, pos)
                pos += n
                return int(v)

            def count(what: str, item_bytes: int) -> int:
                n = take("<Q", what)
                if n * item_bytes > size - pos:
                    raise _HeaderEnd(f"{what} {n} at byte {pos - 8} needs more than the {size - pos} bytes left")
                return n

            def skip_value(vtype: int, what: str) -> None:
                nonlocal pos
                if vtype == GGUF_STRING:
                    n = count(f"{what}: string length", 1)
                    pos += n
                elif vtype == GGUF_ARRAY:
                    item = take("<I", f"{what}: array type")
                    if item not in GGUF_VALUE_SIZES and item != GGUF_STRING:
                        raise _HeaderEnd(f"{what}: array of unknown type {item}")
                    n = count(f"{what}: array length", GGUF_VALUE_SIZES.get(item, 8))
                    if item == GGUF_STRING:
                        for _ in range(n):
                            skip_value(GGUF_STRING, what)
                    else:
                        pos += n * GGUF_VALUE_SIZES[item]
                elif vtype in GGUF_VALUE_SIZES:
                    if pos + GGUF_VALUE_SIZES[vtype] > size:
                        raise _HeaderEnd(f"{what}: value runs past the end of the file")
                    pos += GGUF_VALUE_SIZES[vtype]
                else:
                    raise _HeaderEnd(f"{what}: unknown value type {vtype}")

            try:
                take("<I", "magic")
                version = take("<I", "version")
                if version not in (2, 3):
                    return f"GGUF version {version}, llama.cpp reads 2 and 3"
                n_tensors = count("tensor count", 8 + 4 + 4 + 8)  # name, rank, type, offset: at least 24 bytes
                n_kv = count("key count", 8 + 4)
                for i in range(n_kv):
                    key_at = pos
                    skip_value(GGUF_STRING, f"key {i}")
                    skip_value(take("<I", f"key {i}: type"), f"key {bytes(buf[key_at + 8:pos])[:64]!r}")
                for i in range(n_tensors):
                    skip_value(GGUF_STRING, f"tensor {i}: name")
                    dims = take("<I", f"tensor {i}: rank")
                    if not 1 <= dims <= GGML_MAX_DIMS:
                        return f"tensor {i}: rank {dims}"
                    for _ in range(dims):
                        if take("<q", f"tensor {i}: dimension") < 0:
                            return f"tensor {i}: a negative dimension"
                    take("<I", f"tensor {i}: type")
                    take("<Q", f"tensor {i}: offset")
            except _HeaderEnd as exc:
                return str(exc)
    return None


class _HeaderEnd(Exception):
    """A header field that cannot be (header_problem's walk stops at it)."""


def open_gguf(path: Path, what: str = "file", error: type[MoeplugError] = GGUFError) -> Any:
    """A gguf.GGUFReader of path whose tensors all lie inside the file; every problem is one
    `error` naming it ('no such {what}', not a GGUF, damaged or truncated). Models, profiles and
    route replay files are opened through here."""
    import gguf  # imported lazily: numpy and gguf cost ~0.2 s at start-up

    if not path.exists():
        raise error(f"{path}: no such {what}")
    if path.is_dir():
        raise error(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise error(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    problem = header_problem(path)
    if problem:
        raise error(f"{path}: damaged or truncated GGUF header ({problem})")
    try:
        with warnings.catch_warnings():  # numpy's overflow warnings on hostile offsets: the check below names them
            warnings.simplefilter("ignore")
            reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, ... on damaged headers
        raise error(f"{path}: damaged or truncated GGUF header ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise error(f"{path}: truncated: tensor {t.name} ends past the end of the file")
    return reader


def scalar_or_max(value: Any) -> int | None:
    """Per-layer arrays (some archs store expert counts per layer) collapse to their maximum."""
    if value is None:
        return None
    if isinstance(value, list):
        return max(int(v) for v in value) if value else None
    return int(value)


def _read_metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in reader.fields:
        if key.startswith("GGUF.") or key.startswith("tokenizer."):
            continue
        value = reader.get_field(key).contents()
        if isinstance(value, (str, int, float, bool)) or (isinstance(value, list) and len(value) <= 512):
            out[key] = value
    return out


def _read_tensors(readers: list[Any]) -> list[TensorInfo]:
    tensors = []
    for shard, reader in enumerate(readers):
        for t in reader.tensors:
            tensors.append(
                TensorInfo(
                    name=t.name,
                    qtype=t.tensor_type.name,
                    shape=tuple(int(x) for x in t.shape),
                    n_bytes=int(t.n_bytes),
                    shard=shard,
                )
            )
    return tensors


def _group_expert_layers(tensors: list[TensorInfo]) -> list[MoeLayer]:
    layers: dict[int, MoeLayer] = {}
    for t in tensors:
        m = EXPERT_TENSOR_RE.match(t.name)
        if not m:
            continue
        block = int(m["block"])
        layer = layers.setdefault(block, MoeLayer(block=block, n_expert=0))
        layer.tensors[m["key"]] = t
        if m["key"].endswith("_exps.weight"):
            layer.n_expert = max(layer.n_expert, t.shape[-1])
    return [layers[b] for b in sorted(layers)]


def inspect_model(path: str | Path, dense_ok: bool = False) -> ModelInfo:
    """Read a (possibly split) GGUF MoE model's metadata and tensor table. dense_ok: a model without
    routed experts is read too (no MoE layers; a draft model for speculative decoding)."""
    path = Path(path)
    shards = shard_paths(path)
    readers = [open_gguf(p) for p in shards]
    with about_file(shards[0], GGUFError, "GGUF header"):  # e.g. a key or string that is not UTF-8
        meta = _read_metadata(readers[0])
        tensors = _read_tensors(readers)
    split_count = meta.get("split.count")
    if split_count is not None and int(split_count) != len(shards):
        raise GGUFError(f"{path}: split model declares {split_count} shards but its name says {len(shards)}")

    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{shards[0]}: no general.architecture key")
    layers = _group_expert_layers(tensors)

    if arch not in LLAMA_CPP_ARCHITECTURES:
        if layers:
            raise MoeplugError(
                f"{path}: unknown architecture '{arch}' (llama.cpp b11434 cannot load it) "
                f"although it has routed-expert tensors"
            )
        raise MoeplugError(f"{path}: unknown architecture '{arch}' (llama.cpp b11434 cannot load it)")

    n_expert = scalar_or_max(meta.get(f"{arch}.expert_count")) or 0
    if (not layers or n_expert == 0) and dense_ok:
        layers, n_expert = [], 0
    elif not layers or n_expert == 0:
        raise NotApplicableError(f"{path}: dense model ({arch}): no routed-expert tensors, nothing for moeplug to do")

    n_layer = int(meta.get(f"{arch}.block_count") or 0)
    shared = scalar_or_max(meta.get(f"{arch}.expert_shared_count"))
    if shared is None:
        shared = 1 if any(SHARED_EXPERT_RE.match(t.name) for t in tensors) else 0
    return ModelInfo(
        path=shards[0],
        shards=shards,
        arch=arch,
        name=meta.get("general.name"),
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=scalar_or_max(meta.get(f"{arch}.expert_used_count")) or 0,
        n_expert_shared=shared,
        expert_ff=scalar_or_max(meta.get(f"{arch}.expert_feed_forward_length")),
        layers=layers,
        tensors=tensors,
        metadata=meta,
    )
