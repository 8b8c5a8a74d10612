"""Speculative decoding in a plan: what it costs in VRAM and the llama-server flags that carry it.

Three kinds, as `--spec` names them (llama.cpp b11434, common/arg.cpp and common/speculative.cpp):

- `draft:PATH`, a draft model: `-md PATH -ngld 99 --spec-type draft-simple`. The type must be
  named: with `-md` alone llama-server loads the draft and then drafts nothing (it infers a type
  from the draft's GGUF only for MTP heads and DFlash/DSpark sidecars). `-ngld 99` keeps every layer
  of the draft on the GPU (its default, "auto", leaves that to --fit, which moeplug turns off);
  `-ot` does not reach it (drafts take `-otd`), so its experts, if any, are on the GPU too.
- `mtp`, the model's own MTP (NextN) head: `--spec-type draft-mtp`. llama.cpp then loads the
  NextN blocks (it skips them otherwise: TENSOR_SKIP) and makes a second context over them.
- `ngram`: `--spec-type ngram-simple`, drafts copied from earlier text; no weights, no VRAM.

`--spec-draft-max N` is `--spec-draft-n-max N` for a draft model or MTP head (llama.cpp's default,
3, when not given) and `--spec-ngram-simple-size-m N` for n-grams (default 48).

What the draft holds on the GPU, beside the trunk: a draft model's weights (every tensor), and an
MTP head's NextN blocks, experts included: the head runs once per draft token, one token at a
time, and a round trip to the CPU per drafted token would eat what speculation gains, so its
experts are a whole layer on the GPU (the planner gives that layer every slot and no `-ot` names
it). Then the draft context's KV cache: llama.cpp sizes it at the target's context (n_ctx of the
target), f16 K and V (`-ctkd/-ctvd` default), over every layer of a draft model or over the
NextN blocks only for MTP. Then its compute buffer: one ubatch through the draft graph (the CPU
build allocates the logits of the whole ubatch there, although the draft outputs one row per
sequence), and headroom for its own CUDA pool. Where llama-fit-params measured a draft model (a
GPU), its compute figure is mostly that ubatch of logits over the whole vocabulary (393 of 416 MiB
for the gpt-oss-20b shape's 1-block draft), which the CUDA server does not hold on the GPU: the
draft context there logged 91 MiB of compute and held about 112 MiB more that no buffer names
(NVML less the logged buffers, against the trunk alone; run 2026-12-02-server-rounds-vram). So the
plan takes llama.cpp's figure less those logits, plus CostModel.draft_context_extra for the rest.

The trunk's verification batches are k = draft_max + 1 tokens, which the planner's cost model
takes as tokens_per_step (allocate.py). N-gram drafts come only where the text repeats itself, so
most steps verify no draft: the planner keeps k = 1 for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moeplug.core.errors import EXIT_USAGE, MoeplugError
from moeplug.planner.estimates import compute_buffer_bytes, kv_cache_bytes, logits_bytes, nextn_layers
from moeplug.planner.fit_estimate import DeviceNeed
from moeplug.model.inspect import ModelInfo, inspect_model
from moeplug.planner.costs import DEFAULT_COSTS, CostModel

DEFAULT_DRAFT_MAX = 3  # llama.cpp common.h: common_params_speculative_draft::n_max
DEFAULT_NGRAM_MAX = 48  # llama.cpp common.h: common_params_speculative_ngram_map::size_m


@dataclass(frozen=True)
class Speculation:
    kind: str  # "draft", "mtp" or "ngram"
    draft: str | None = None  # the draft model (kind "draft")
    draft_max: int | None = None  # tokens drafted per step; None: llama.cpp's default

    @property
    def n_draft(self) -> int:
        if self.draft_max is not None:
            return self.draft_max
        return DEFAULT_NGRAM_MAX if self.kind == "ngram" else DEFAULT_DRAFT_MAX

    @property
    def tokens_per_step(self) -> int:
        """k, the tokens one verification batch of the trunk holds (1 for n-grams: module docstring)."""
        return 1 if self.kind == "ngram" else self.n_draft + 1

    @property
    def spec_type(self) -> str:
        return {"draft": "draft-simple", "mtp": "draft-mtp", "ngram": "ngram-simple"}[self.kind]

    def server_args(self, gpu: bool) -> list[str]:
        """The llama-server flags; gpu: the draft model's layers on the GPU (-ngld 99), else 0."""
        args = ["-md", str(self.draft), "-ngld", "99" if gpu else "0"] if self.kind == "draft" else []
        args += ["--spec-type", self.spec_type]
        if self.kind == "ngram":
            return args + ["--spec-ngram-simple-size-m", str(self.n_draft)]
        return args + ["--spec-draft-n-max", str(self.n_draft)]

    def describe(self) -> str:
        what = {"draft": f"draft model {self.draft}", "mtp": "the model's MTP head", "ngram": "n-gram drafts"}
        return f"{what[self.kind]} (--spec-type {self.spec_type}), up to {self.n_draft} tokens per step"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"spec_type": self.spec_type, "n_draft": self.n_draft,
                               "tokens_per_step": self.tokens_per_step}

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> Speculation | None:
        return cls(doc["kind"], doc.get("draft"), doc.get("draft_max")) if doc else None


@dataclass(frozen=True)
class KeepInstalled:
    """An installed model's own speculation (kept in its plan), with draft_max tokens where given:
    `plan NAME` and `serve NAME` without --spec."""

    draft_max: int | None = None

    def resolve(self, installed: dict[str, Any] | None) -> Speculation | None:
        """installed: the plan's `speculation` (None: none, or not an installed model)."""
        spec = Speculation.from_json(installed)
        if self.draft_max is None:
            return spec
        if spec is None:
            raise MoeplugError("--spec-draft-max needs a --spec (draft:PATH, mtp or ngram)", EXIT_USAGE)
        return Speculation(spec.kind, spec.draft, self.draft_max)


def parse_spec(text: str | None, draft_max: int | None = None, keep: bool = False) -> Speculation | KeepInstalled | None:
    """`--spec` and `--spec-draft-max` as the user wrote them: draft:PATH, mtp, ngram, or none (None:
    no speculation); keep and no --spec: the installed model's (KeepInstalled). The draft's file is
    checked where the plan is made (spec_need)."""
    if keep and text is None:
        return KeepInstalled(draft_max)
    return _parse(text, draft_max)


def _parse(text: str | None, draft_max: int | None) -> Speculation | None:
    if text is None or text == "none":
        return KeepInstalled(draft_max).resolve(None) if text is None else None
    kind, sep, path = text.partition(":")
    if kind == "draft" and sep:
        if not path:
            raise MoeplugError("--spec draft: names no file; write --spec draft:PATH.gguf", EXIT_USAGE)
        return Speculation("draft", str(Path(path).expanduser().resolve()), draft_max)
    if kind in ("mtp", "ngram") and not sep:
        return Speculation(kind, None, draft_max)
    raise MoeplugError(f"--spec {text!r}: expected draft:PATH, mtp, ngram or none", EXIT_USAGE)


@dataclass(frozen=True)
class SpecNeed:
    """VRAM the draft takes beside the trunk (bytes)."""

    weights: int
    kv_cache: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


NO_NEED = SpecNeed(0, 0, 0)


def nextn_blocks(info: ModelInfo) -> set[int]:
    """The block indices of the model's MTP (NextN) blocks, the last ones."""
    return set(range(info.n_layer - nextn_layers(info), info.n_layer))


def nextn_weight_bytes(info: ModelInfo) -> int:
    """Every tensor of the NextN blocks, their experts included."""
    prefixes = tuple(f"blk.{b}." for b in nextn_blocks(info))
    return sum(t.n_bytes for t in info.tensors if t.name.startswith(prefixes)) if prefixes else 0


def draft_compute_bytes(info: ModelInfo, costs: CostModel = DEFAULT_COSTS) -> int:
    """The draft context's compute buffer: moeplug's estimate for one ubatch (estimates.py; the CPU
    build allocates logits for the whole ubatch there too), and pool headroom of its own CUDA
    context, a quarter of the trunk's (not measured on a GPU yet)."""
    return compute_buffer_bytes(info) + costs.cuda_pool_headroom // 4


def read_draft(spec: Speculation) -> ModelInfo:
    path = Path(str(spec.draft))
    if not path.is_file():
        raise MoeplugError(f"--spec draft:{spec.draft}: no such file")
    return inspect_model(path, dense_ok=True)


def draft_weight_bytes(draft: ModelInfo) -> int:
    """A draft model's weights on the GPU: every tensor but the token embeddings, which llama.cpp
    keeps in RAM (its input layer is always the CPU's), unless the output matrix is tied to them."""
    names = {t.name for t in draft.tensors}
    tied = "output.weight" not in names
    return sum(t.n_bytes for t in draft.tensors if tied or t.name != "token_embd.weight")


def spec_need(info: ModelInfo, spec: Speculation | None, ctx: int, measured: DeviceNeed | None = None,
              costs: CostModel = DEFAULT_COSTS) -> SpecNeed:
    """What the draft holds on the GPU for a server of `info` at ctx tokens (module docstring).
    measured: llama.cpp's own estimate for the draft model alone (fit_estimate.gpu_need with every
    weight on the GPU), which replaces moeplug's where llama-fit-params saw a GPU."""
    if spec is None or spec.kind == "ngram":
        return NO_NEED
    if spec.kind == "mtp":
        if not nextn_blocks(info) or not nextn_weight_bytes(info):
            raise MoeplugError(f"--spec mtp: {info.path} has no MTP (NextN) block "
                               f"({info.arch}.nextn_predict_layers is not set or its blocks hold no tensor)")
        return SpecNeed(nextn_weight_bytes(info), kv_cache_bytes(info, ctx, mtp=True), draft_compute_bytes(info, costs))
    draft = read_draft(spec)
    if measured is not None:
        return SpecNeed(measured.model, measured.context,
                        max(measured.compute - logits_bytes(draft), 0) + costs.draft_context_extra)
    return SpecNeed(draft_weight_bytes(draft), kv_cache_bytes(draft, ctx), draft_compute_bytes(draft, costs))
