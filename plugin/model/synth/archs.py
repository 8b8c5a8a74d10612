"""What a synthetic model of each architecture family contains: metadata and tensor plan.

Tensor names and shapes follow llama.cpp b11434's loaders (`src/models/<arch>.cpp`); shapes are
ggml `ne` order (ne[0] is the row length). Three families cover the expert layouts moeplug must
handle:

- `qwen3moe`: separate gate/up/down expert tensors (optionally per-expert scales).
- `hy_v3`:    fused `ffn_gate_up_exps`, a shared expert, a sigmoid router with a selection
              bias, leading dense blocks (so not every block is MoE), and optionally an MTP
              (NextN) block after the trunk, with experts of its own.
- `gpt-oss`:  expert biases (`*_exps.bias`, through ADD_ID), router bias, attention sinks,
              sliding-window attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

ARCHS = ("qwen3moe", "hy_v3", "gpt-oss")

DTYPES: dict[str, QT] = {
    "f32": QT.F32,
    "f16": QT.F16,
    "q8_0": QT.Q8_0,
    "q4_0": QT.Q4_0,
    "q4_k": QT.Q4_K,
    "mxfp4": QT.MXFP4,  # gpt-oss's own expert format (E8M0 scale + 32 E2M1 values per block)
}

# general.file_type (llama_ftype) written for each dtype
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k": 15, "mxfp4": 38}  # 38: MXFP4_MOE

# When a row length is not a multiple of the block size, fall back the way llama-quantize does.
_FALLBACK = {QT.Q4_K: QT.Q8_0, QT.Q4_0: QT.Q8_0, QT.MXFP4: QT.Q8_0, QT.Q8_0: QT.F16}


@dataclass(frozen=True)
class ModelSpec:
    arch: str = "qwen3moe"
    layers: int = 4
    experts: int = 16
    used: int = 4
    embd: int = 256
    expert_ff: int = 128
    heads: int = 4
    heads_kv: int = 2
    head_dim: int = 64
    dtype: str = "f32"
    expert_dtype: str | None = None  # the routed experts' type; default dtype (gpt-oss ships them in mxfp4)
    seed: int = 1234
    ctx: int = 4096
    dense_ff: int = 0  # dense FFN width (hy_v3 leading blocks); 0 = used * expert_ff
    leading_dense: int | None = None  # hy_v3: dense blocks before the MoE ones (default 1)
    shared_ff: int = 0  # hy_v3 shared-expert width; 0 = expert_ff
    expert_scales: bool = False  # qwen3moe: per-expert `*_exps.scale` tensors
    mtp_layers: int = 0  # hy_v3: MTP (NextN) blocks after the trunk
    tied: bool = False  # no output.weight (gpt-oss always writes one)
    sliding_window: int = 128  # gpt-oss
    vocab_size: int | None = None  # pad the built-in vocab to this many tokens
    w_scale: float = 1.0
    router_scale: float = 2.0
    name: str | None = None

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown --arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        for opt, value in (("--dtype", self.dtype), ("--expert-dtype", self.expert_dtype or self.dtype)):
            if value not in DTYPES:
                raise ValueError(f"unknown {opt} {value!r}; choose one of {', '.join(DTYPES)}")
        for attr in ("layers", "experts", "used", "embd", "expert_ff", "heads", "heads_kv", "head_dim"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"--{attr.replace('_', '-')} must be positive")
        if self.used > self.experts:
            raise ValueError(f"--used {self.used} is larger than --experts {self.experts}")
        if self.heads % self.heads_kv:
            raise ValueError(f"--heads {self.heads} is not a multiple of --heads-kv {self.heads_kv}")
        if self.mtp_layers and self.arch != "hy_v3":
            raise ValueError("--mtp-layers is only wired for hy_v3 (its loader reads NextN blocks)")
        if self.mtp_layers < 0:
            raise ValueError("--mtp-layers must not be negative")
        if self.expert_scales and self.arch != "qwen3moe":
            raise ValueError("--expert-scales is only wired for qwen3moe (its graph applies them)")
        if self.n_leading_dense >= self.layers:
            raise ValueError("every block would be dense: raise --layers or lower --leading-dense")

    @property
    def n_expert_dtype(self) -> str:
        return self.expert_dtype or self.dtype

    @property
    def n_leading_dense(self) -> int:
        if self.arch != "hy_v3":
            return 0
        return 1 if self.leading_dense is None else self.leading_dense

    @property
    def n_dense_ff(self) -> int:
        return self.dense_ff or self.used * self.expert_ff

    @property
    def n_shared_ff(self) -> int:
        return self.shared_ff or self.expert_ff

    @property
    def model_name(self) -> str:
        return self.name or (
            f"moeplug-synthetic-{self.arch}-L{self.layers}-E{self.experts}x{self.used}-d{self.embd}-{self.dtype}"
        )


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]  # ggml order
    qtype: QT
    kind: str  # "linear", "norm", "router", "bias", "embd", "scale", "sinks"
    std: float = 0.0

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        n = math.prod(self.ne)
        assert n % block == 0
        return n // block * type_size


@dataclass
class ModelPlan:
    spec: ModelSpec
    metadata: list[tuple[str, object, VT]] = field(default_factory=list)
    tensors: list[TensorPlan] = field(default_factory=list)


def weight_type(dtype: str, row_len: int) -> QT:
    """The type a 2D/3D weight gets: the requested dtype, or a fallback that fits its rows."""
    qt = DTYPES[dtype]
    while GGML_QUANT_SIZES[qt][0] > 1 and row_len % GGML_QUANT_SIZES[qt][0]:
        qt = _FALLBACK[qt]
    return qt


def plan_model(spec: ModelSpec, n_vocab: int) -> ModelPlan:
    spec.validate()
    plan = ModelPlan(spec)
    _add_metadata(plan)
    _add_tensors(plan, n_vocab)
    return plan


def _add_metadata(plan: ModelPlan) -> None:
    s, a = plan.spec, plan.spec.arch
    md = plan.metadata

    def kv(key: str, value: object, vtype: VT) -> None:
        md.append((key, value, vtype))

    kv("general.name", s.model_name, VT.STRING)
    kv("general.file_type", FILE_TYPES[s.n_expert_dtype if s.n_expert_dtype == "mxfp4" else s.dtype], VT.UINT32)
    kv("general.quantization_version", 2, VT.UINT32)
    kv(f"{a}.block_count", s.layers + s.mtp_layers, VT.UINT32)  # NextN blocks count as blocks
    kv(f"{a}.context_length", s.ctx, VT.UINT32)
    kv(f"{a}.embedding_length", s.embd, VT.UINT32)
    kv(f"{a}.feed_forward_length", s.n_dense_ff, VT.UINT32)
    kv(f"{a}.attention.head_count", s.heads, VT.UINT32)
    kv(f"{a}.attention.head_count_kv", s.heads_kv, VT.UINT32)
    kv(f"{a}.attention.key_length", s.head_dim, VT.UINT32)
    kv(f"{a}.attention.value_length", s.head_dim, VT.UINT32)
    kv(f"{a}.rope.freq_base", 1.0e6 if a != "gpt-oss" else 1.5e5, VT.FLOAT32)
    kv(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if a != "gpt-oss" else 1e-5, VT.FLOAT32)
    kv(f"{a}.expert_count", s.experts, VT.UINT32)
    kv(f"{a}.expert_used_count", s.used, VT.UINT32)
    kv(f"{a}.expert_feed_forward_length", s.expert_ff, VT.UINT32)
    if a == "hy_v3":
        kv(f"{a}.expert_shared_count", 1, VT.UINT32)
        kv(f"{a}.expert_shared_feed_forward_length", s.n_shared_ff, VT.UINT32)
        kv(f"{a}.leading_dense_block_count", s.n_leading_dense, VT.UINT32)
        kv(f"{a}.expert_gating_func", 2, VT.UINT32)  # sigmoid
        kv(f"{a}.expert_weights_norm", True, VT.BOOL)
        kv(f"{a}.expert_weights_scale", 1.0, VT.FLOAT32)
        if s.mtp_layers:
            kv(f"{a}.nextn_predict_layers", s.mtp_layers, VT.UINT32)
    if a == "gpt-oss":
        kv(f"{a}.attention.sliding_window", s.sliding_window, VT.UINT32)


def _add_tensors(plan: ModelPlan, n_vocab: int) -> None:
    s = plan.spec
    D, E, F = s.embd, s.experts, s.expert_ff
    q_dim, kv_dim = s.heads * s.head_dim, s.heads_kv * s.head_dim
    t = plan.tensors

    def linear(name: str, ne: tuple[int, ...]) -> None:
        # std 1/sqrt(fan_in) keeps activations at unit scale through every matmul
        dtype = s.n_expert_dtype if name.endswith("_exps.weight") else s.dtype
        t.append(TensorPlan(name, ne, weight_type(dtype, ne[0]), "linear", s.w_scale / math.sqrt(ne[0])))

    def f32(name: str, ne: tuple[int, ...], kind: str, std: float = 0.0) -> None:
        t.append(TensorPlan(name, ne, QT.F32, kind, std))

    t.append(TensorPlan("token_embd.weight", (D, n_vocab), weight_type(s.dtype, D), "embd", 0.02))
    f32("output_norm.weight", (D,), "norm")
    if not s.tied or s.arch == "gpt-oss":
        linear("output.weight", (D, n_vocab))

    for i in range(s.layers + s.mtp_layers):
        p = f"blk.{i}."
        if i >= s.layers:  # an MTP block: the NextN projections, then a whole decoder block
            linear(p + "nextn.eh_proj.weight", (2 * D, D))
            f32(p + "nextn.enorm.weight", (D,), "norm")
            f32(p + "nextn.hnorm.weight", (D,), "norm")
            f32(p + "nextn.shared_head_norm.weight", (D,), "norm")
        f32(p + "attn_norm.weight", (D,), "norm")
        linear(p + "attn_q.weight", (D, q_dim))
        linear(p + "attn_k.weight", (D, kv_dim))
        linear(p + "attn_v.weight", (D, kv_dim))
        linear(p + "attn_output.weight", (q_dim, D))
        if s.arch in ("qwen3moe", "hy_v3"):
            f32(p + "attn_q_norm.weight", (s.head_dim,), "norm")
            f32(p + "attn_k_norm.weight", (s.head_dim,), "norm")
            f32(p + "ffn_norm.weight", (D,), "norm")
        if s.arch == "gpt-oss":
            f32(p + "attn_output.bias", (D,), "bias", 0.02)
            f32(p + "attn_sinks.weight", (s.heads,), "sinks", 1.0)
            f32(p + "post_attention_norm.weight", (D,), "norm")

        if i < s.n_leading_dense:  # hy_v3 leading dense FFN block
            linear(p + "ffn_gate.weight", (D, s.n_dense_ff))
            linear(p + "ffn_up.weight", (D, s.n_dense_ff))
            linear(p + "ffn_down.weight", (s.n_dense_ff, D))
            continue

        f32(p + "ffn_gate_inp.weight", (D, E), "router", s.router_scale / math.sqrt(D))
        if s.arch == "hy_v3":
            f32(p + "exp_probs_b", (E,), "bias", 0.1)
            linear(p + "ffn_gate_up_exps.weight", (D, 2 * F, E))
            linear(p + "ffn_down_exps.weight", (F, D, E))
            linear(p + "ffn_gate_shexp.weight", (D, s.n_shared_ff))
            linear(p + "ffn_up_shexp.weight", (D, s.n_shared_ff))
            linear(p + "ffn_down_shexp.weight", (s.n_shared_ff, D))
            continue

        linear(p + "ffn_gate_exps.weight", (D, F, E))
        linear(p + "ffn_up_exps.weight", (D, F, E))
        linear(p + "ffn_down_exps.weight", (F, D, E))
        if s.arch == "gpt-oss":
            f32(p + "ffn_gate_inp.bias", (E,), "bias", 0.1)
            f32(p + "ffn_gate_exps.bias", (F, E), "bias", 0.02)
            f32(p + "ffn_up_exps.bias", (F, E), "bias", 0.02)
            f32(p + "ffn_down_exps.bias", (D, E), "bias", 0.02)
        if s.expert_scales:
            for part in ("gate", "up", "down"):
                f32(p + f"ffn_{part}_exps.scale", (E,), "scale")
