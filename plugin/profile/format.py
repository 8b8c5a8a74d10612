"""The moe profile file (native/PROFILE-FORMAT.md): read, validate, merge, write.

A profile records which experts a model's router selected; it applies to one model, identified
by a fingerprint that both llama-moe-profile and this module compute from the model's GGUF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from moeplug.core.errors import MoeplugError, about_file
from moeplug.core.fsutil import atomic_gguf

PROFILE_VERSION = 1
EXPERT_TENSOR_RE = re.compile(r"^blk\.\d+\..*_(?:exps|chexps)\.")
PHASE_PREFILL, PHASE_DECODE = 0, 1


class ProfileError(MoeplugError):
    """A profile that cannot be read, or that belongs to another model."""


@dataclass(frozen=True)
class ModelFingerprint:
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    size: int
    meta_hash: str
    expert_tensors: tuple[str, ...]
    expert_shapes: tuple[tuple[int, int, int, int], ...]
    expert_types: tuple[int, ...]

    @property
    def key(self) -> str:
        """A file-name-safe id: where this model's profile is stored."""
        return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.arch)}-{self.meta_hash}"

    def differences(self, other: ModelFingerprint) -> list[str]:
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f.name if isinstance(a, tuple) else f"{f.name} {a} vs {b}")
        return out

    def bytes_per_expert(self, down_tensor: str) -> int:
        """Bytes of one expert of the layer whose down weight is `down_tensor`."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        prefix = down_tensor.split(".ffn_")[0] + "."
        total = 0
        for name, shape, qtype in zip(self.expert_tensors, self.expert_shapes, self.expert_types):
            if not name.startswith(prefix):
                continue
            dims = list(shape)
            while len(dims) > 1 and dims[-1] == 1:
                dims.pop()
            n_per_expert = int(np.prod(dims)) // dims[-1]  # the outermost dimension is the expert axis
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            total += n_per_expert // block * type_size
        return total


def fnv1a64_hex(data: bytes) -> str:
    h = 0xCBF29CE484222325
    prime, mask = 0x100000001B3, 0xFFFFFFFFFFFFFFFF
    for byte in data:
        h = ((h ^ byte) * prime) & mask
    return f"{h:016x}"


def model_fingerprint(model_path: str | Path) -> ModelFingerprint:
    """The fingerprint llama-moe-profile writes, computed from the model's GGUF header(s)."""
    from moeplug.model.inspect import open_gguf, scalar_or_max, shard_paths

    shards = shard_paths(Path(model_path))
    first = open_gguf(shards[0], "model")

    def u32(key: str) -> int:
        f = first.get_field(key)
        return (scalar_or_max(f.contents()) if f is not None else None) or 0

    arch = str(first.get_field("general.architecture").contents())
    with open(shards[0], "rb") as fh:
        meta_hash = fnv1a64_hex(fh.read(first.data_offset))
    names, shapes, types = [], [], []
    for path in shards:
        reader = first if path == shards[0] else open_gguf(path, "model")
        for t in reader.tensors:
            if EXPERT_TENSOR_RE.match(t.name):
                ne = [int(x) for x in t.shape] + [1] * (4 - len(t.shape))
                names.append(t.name)
                shapes.append(tuple(ne[:4]))
                types.append(int(t.tensor_type))
    return ModelFingerprint(
        arch=arch, n_layer=u32(f"{arch}.block_count"), n_expert=u32(f"{arch}.expert_count"),
        n_expert_used=u32(f"{arch}.expert_used_count"), size=sum(p.stat().st_size for p in shards),
        meta_hash=meta_hash, expert_tensors=tuple(names), expert_shapes=tuple(shapes), expert_types=tuple(types),
    )


@dataclass
class ProfileSource:
    """One run of the profiler: its prompts' routing, token by token."""

    label: str
    prompt_labels: list[str]
    seq: np.ndarray  # int16 [n_steps, n_tensors, n_expert_used]
    meta: np.ndarray  # int32 [n_steps, 3]: prompt, pos, phase
    n_predict: int = 0
    seed: int = 0
    temp: float = 0.0
    weight: float = 1.0  # what its selections count for: < 1 once newer sources aged it (merge_decayed)

    def phase_steps(self, phase: int) -> np.ndarray:
        """The selected ids of the steps in one phase: [n_steps_phase, n_tensors, k]."""
        return self.seq[self.meta[:, 2] == phase]


@dataclass
class Profile:
    fingerprint: ModelFingerprint
    tensors: list[str]  # expert down weights, one per MoE layer
    counts_prefill: np.ndarray  # int64 [n_tensors, n_expert]
    counts_decode: np.ndarray
    sources: list[ProfileSource] = field(default_factory=list)
    version: int = PROFILE_VERSION
    # tokens of the sources without sequences (llama-server's `live` counts), [prefill, decode]:
    # the counts cover them, no seq tensor holds them
    unsequenced_tokens: tuple[int, int] = (0, 0)

    @property
    def n_expert(self) -> int:
        return int(self.counts_decode.shape[1])

    @property
    def n_expert_used(self) -> int:
        return self.fingerprint.n_expert_used

    def tokens(self, phase: int) -> int:
        """Tokens the counts cover in a phase (as recorded, not weighted)."""
        return self.sequenced_tokens(phase) + self.unsequenced_tokens[phase]

    def sequenced_tokens(self, phase: int) -> int:
        return int(sum(int((s.meta[:, 2] == phase).sum()) for s in self.sources))

    def check_model(self, fp: ModelFingerprint) -> None:
        diffs = self.fingerprint.differences(fp)
        if diffs:
            raise ProfileError(f"profile is of another model: {', '.join(diffs)} differ "
                               f"(profile: {self.fingerprint.arch}, hash {self.fingerprint.meta_hash}; "
                               f"model: {fp.arch}, hash {fp.meta_hash})")


def _field(reader: Any, key: str, required: bool = True) -> Any:
    f = reader.get_field(key)
    if f is None:
        if required:
            raise ProfileError(f"missing key {key}")
        return None
    return f.contents()


def read_profile(path: str | Path) -> Profile:
    """Read and check a profile file; every problem is one ProfileError naming it."""
    from moeplug.model.inspect import open_gguf

    path = Path(path)
    reader = open_gguf(path, "profile file", ProfileError)
    with about_file(path, ProfileError, "profile"):
        if _field(reader, "general.type", required=False) != "moe-profile":
            raise ProfileError("not a moe profile (general.type is not 'moe-profile')")
        version = int(_field(reader, "moe_profile.version"))
        if version != PROFILE_VERSION:
            raise ProfileError(f"unsupported profile version {version} (this moeplug reads version {PROFILE_VERSION})")
        return _parse(reader)


def _parse(reader: Any) -> Profile:
    shapes = [int(x) for x in _field(reader, "moe_profile.model.expert_shapes")]
    fp = ModelFingerprint(
        arch=str(_field(reader, "moe_profile.model.arch")),
        n_layer=int(_field(reader, "moe_profile.model.n_layer")),
        n_expert=int(_field(reader, "moe_profile.model.n_expert")),
        n_expert_used=int(_field(reader, "moe_profile.model.n_expert_used")),
        size=int(_field(reader, "moe_profile.model.size")),
        meta_hash=str(_field(reader, "moe_profile.model.meta_hash")),
        expert_tensors=tuple(_field(reader, "moe_profile.model.expert_tensors")),
        expert_shapes=tuple(tuple(shapes[i:i + 4]) for i in range(0, len(shapes), 4)),  # type: ignore[misc]
        expert_types=tuple(int(x) for x in _field(reader, "moe_profile.model.expert_types")),
    )
    tensors = {t.name: t for t in reader.tensors}
    names = list(_field(reader, "moe_profile.tensors"))
    counts = {ph: np.array(tensors[f"counts.{ph}"].data, dtype=np.int64).reshape(len(names), -1)
              for ph in ("prefill", "decode")}
    sources = []
    for i, label in enumerate(_field(reader, "moe_profile.sources")):
        k = fp.n_expert_used
        if f"seq.{i}" in tensors:
            seq = np.array(tensors[f"seq.{i}"].data, dtype=np.int16).reshape(-1, len(names), k)
            meta = np.array(tensors[f"seq_meta.{i}"].data, dtype=np.int32).reshape(-1, 3)
        else:
            seq, meta = np.zeros((0, len(names), k), np.int16), np.zeros((0, 3), np.int32)
        if len(seq) != len(meta):
            raise ProfileError(f"seq.{i} and seq_meta.{i} disagree on the number of tokens")
        p = f"moe_profile.source.{i}."
        sources.append(ProfileSource(
            label=str(label), prompt_labels=list(_field(reader, p + "prompt_labels", required=False) or []),
            seq=seq, meta=meta, n_predict=int(_field(reader, p + "n_predict", required=False) or 0),
            seed=int(_field(reader, p + "seed", required=False) or 0),
            temp=float(_field(reader, p + "temp", required=False) or 0.0),
            weight=float(_field(reader, p + "weight", required=False) or 1.0),
        ))
    profile = Profile(fingerprint=fp, tensors=names, counts_prefill=counts["prefill"],
                      counts_decode=counts["decode"], sources=sources)
    _check_values(profile)
    unsequenced = [0, 0]
    every_source_sequenced = bool(sources) and all(len(s.seq) for s in sources)
    for phase, key in ((PHASE_PREFILL, "prefill"), (PHASE_DECODE, "decode")):
        stored, held = int(_field(reader, f"moe_profile.tokens.{key}")), profile.sequenced_tokens(phase)
        if (stored != held) if every_source_sequenced else (stored < held):
            raise ProfileError(f"moe_profile.tokens.{key} is {stored} but the sequences hold {held}")
        unsequenced[phase] = stored - held
    profile.unsequenced_tokens = (unsequenced[0], unsequenced[1])
    return profile


def _check_values(profile: Profile) -> None:
    """Counts and ids a damaged file could hold but no profiler writes: negative counts, and
    selected ids outside [0, n_expert) other than -1 (not routed)."""
    if profile.counts_prefill.shape != profile.counts_decode.shape:
        raise ProfileError("counts.prefill and counts.decode differ in shape")
    if (profile.counts_prefill < 0).any() or (profile.counts_decode < 0).any():
        raise ProfileError("negative expert counts")
    for i, s in enumerate(profile.sources):
        if ((s.seq < -1) | (s.seq >= profile.n_expert)).any():
            raise ProfileError(f"seq.{i} holds expert ids outside 0-{profile.n_expert - 1}")
        if not np.isin(s.meta[:, 2], (PHASE_PREFILL, PHASE_DECODE)).all():
            raise ProfileError(f"seq_meta.{i} holds a phase other than 0 (prefill) and 1 (decode)")


def merge_profiles(profiles: list[Profile], scales: list[float] | None = None) -> Profile:
    """Counts add up; each source keeps its own sequences. Refuses profiles of different models.
    scales: one factor per profile for its counts and its sources' weights (default 1: a plain sum);
    scaled counts are rounded to the nearest integer."""
    if not profiles:
        raise ProfileError("nothing to merge")
    scales = scales or [1.0] * len(profiles)
    first = profiles[0]
    for other in profiles[1:]:
        other.check_model(first.fingerprint)
        if other.tensors != first.tensors:
            raise ProfileError("profiles recorded different expert tensors (one of them ran an MTP head?)")

    def total(phase: str) -> np.ndarray:
        summed = sum((getattr(p, phase) * f for p, f in zip(profiles, scales)), np.zeros(first.counts_decode.shape))
        return np.rint(summed).astype(np.int64)

    return Profile(
        fingerprint=first.fingerprint,
        tensors=list(first.tensors),
        counts_prefill=total("counts_prefill"),
        counts_decode=total("counts_decode"),
        sources=[replace(s, weight=s.weight * f) for p, f in zip(profiles, scales) for s in p.sources],
        unsequenced_tokens=(sum(p.unsequenced_tokens[0] for p in profiles),
                            sum(p.unsequenced_tokens[1] for p in profiles)),
    )


def merge_decayed(old: Profile, new: Profile, half_life: int) -> Profile:
    """The stored profile `old` aged by the tokens of `new`, plus `new`: exponential decay by token
    age. With T the prompt and generated tokens `new` covers, old's counts and the weights of its
    sources are multiplied by 0.5 ** (T / half_life) (rounded to whole counts), and new's are
    added at weight 1. A selection recorded `half_life` tokens before the latest one counts half."""
    if half_life <= 0:
        raise ProfileError(f"a half-life of {half_life} tokens: give a positive number")
    age = new.tokens(PHASE_PREFILL) + new.tokens(PHASE_DECODE)
    return merge_profiles([old, new], [0.5 ** (age / half_life), 1.0])


def write_profile(profile: Profile, path: str | Path) -> Path:
    """Write atomically (a reader never sees half a profile)."""
    import gguf

    path = Path(path)
    fp = profile.fingerprint
    with atomic_gguf(path, "moe-profile") as w:
        w.add_string("general.type", "moe-profile")
        w.add_uint32("moe_profile.version", PROFILE_VERSION)
        w.add_string("moe_profile.model.arch", fp.arch)
        w.add_uint32("moe_profile.model.n_layer", fp.n_layer)
        w.add_uint32("moe_profile.model.n_expert", fp.n_expert)
        w.add_uint32("moe_profile.model.n_expert_used", fp.n_expert_used)
        w.add_uint64("moe_profile.model.size", fp.size)
        w.add_string("moe_profile.model.meta_hash", fp.meta_hash)
        w.add_array("moe_profile.model.expert_tensors", list(fp.expert_tensors))
        w.add_key_value("moe_profile.model.expert_shapes", [int(x) for s in fp.expert_shapes for x in s],
                        gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
        w.add_key_value("moe_profile.model.expert_types", list(fp.expert_types),
                        gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        w.add_array("moe_profile.tensors", list(profile.tensors))
        w.add_uint64("moe_profile.tokens.prefill", profile.tokens(PHASE_PREFILL))
        w.add_uint64("moe_profile.tokens.decode", profile.tokens(PHASE_DECODE))
        w.add_array("moe_profile.sources", [s.label for s in profile.sources])
        w.add_tensor("counts.prefill", profile.counts_prefill.astype(np.int32))
        w.add_tensor("counts.decode", profile.counts_decode.astype(np.int32))
        for i, s in enumerate(profile.sources):
            p = f"moe_profile.source.{i}."
            if s.prompt_labels:
                w.add_array(p + "prompt_labels", s.prompt_labels)
            w.add_uint32(p + "n_predict", s.n_predict)
            w.add_uint32(p + "seed", s.seed)
            w.add_float32(p + "temp", s.temp)
            if s.weight != 1.0:
                w.add_float32(p + "weight", s.weight)
            if len(s.seq):
                w.add_tensor(f"seq.{i}", np.ascontiguousarray(s.seq, dtype=np.int16))
                w.add_tensor(f"seq_meta.{i}", np.ascontiguousarray(s.meta, dtype=np.int32))
    return path
