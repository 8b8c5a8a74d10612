"""What llama.cpp puts in memory beside the experts, estimated from a model's GGUF header.

The planner (plan.py) subtracts these from the VRAM budget: the KV cache at a context size, the
compute buffer of one ubatch plus CUDA pool headroom, and a safety margin; it also reads the
model's training context here and compares stock llama.cpp's placements (`-ncmoe K`, whole
layers first) at the same room.
"""

from __future__ import annotations

from moeplug.core.errors import EXIT_USAGE, MoeplugError
from moeplug.model.inspect import ModelInfo, MoeLayer, scalar_or_max
from moeplug.core.sizes import GIB
from moeplug.planner.costs import DEFAULT_COSTS, CostModel

DEFAULT_UBATCH = 512  # llama-server's physical batch (-ub)
DEFAULT_BATCH = 2048  # and its logical batch (-b), never below the physical one
# the smallest -ub moeplug plans for: llama.cpp offloads a prompt batch's host weights to the GPU
# from 32 tokens (ggml_backend_cuda's op offload threshold); below it every batch runs on the CPU
MIN_UBATCH = 32
DEFAULT_CTX = 4096


def training_context(info: ModelInfo) -> int | None:
    """The context length the model was trained with ({arch}.context_length), or None."""
    return scalar_or_max(info.metadata.get(f"{info.arch}.context_length")) or None


def context_size(info: ModelInfo, ctx: int | None, override: bool = False) -> int:
    """The context to plan and serve: ctx, or (None) DEFAULT_CTX capped at the training context.
    Above the training context only with override (--ctx-override): a usage error otherwise."""
    trained = training_context(info)
    if ctx is None:
        return min(DEFAULT_CTX, trained) if trained else DEFAULT_CTX
    if trained and ctx > trained and not override:
        raise MoeplugError(f"--ctx {ctx} is above the model's training context ({trained}); lower it, or pass "
                           f"--ctx-override to use it anyway", EXIT_USAGE)
    return ctx


def nextn_layers(info: ModelInfo) -> int:
    """The model's MTP (NextN) blocks, the last ones: llama.cpp loads them only for an MTP draft."""
    return scalar_or_max(info.metadata.get(f"{info.arch}.nextn_predict_layers")) or 0


def kv_cache_bytes(info: ModelInfo, ctx: int, bytes_per_value: int = 2, mtp: bool = False) -> int:
    """f16 K and V for every attention layer of the trunk at ctx tokens (an upper bound for
    SWA/hybrid models); mtp: those of the MTP (NextN) blocks instead, which an MTP draft context
    holds at the same ctx."""
    return sum(kv_cache_bytes_per_block(info, ctx, bytes_per_value, mtp))


def kv_cache_bytes_per_block(info: ModelInfo, ctx: int, bytes_per_value: int = 2, mtp: bool = False) -> list[int]:
    """kv_cache_bytes by block (llama.cpp keeps a layer's KV cache on that layer's device): the
    trunk's blocks, or with mtp the NextN (MTP) blocks, the last ones, the others none."""
    md, arch = info.metadata, info.arch
    n_head = scalar_or_max(md.get(f"{arch}.attention.head_count")) or 1
    n_head_kv = scalar_or_max(md.get(f"{arch}.attention.head_count_kv")) or n_head
    n_embd = scalar_or_max(md.get(f"{arch}.embedding_length")) or 0
    k_len = scalar_or_max(md.get(f"{arch}.attention.key_length")) or n_embd // n_head
    v_len = scalar_or_max(md.get(f"{arch}.attention.value_length")) or k_len
    n_trunk = info.n_layer - nextn_layers(info)
    per_layer = ctx * n_head_kv * (k_len + v_len) * bytes_per_value
    return [per_layer if (block >= n_trunk) == mtp else 0 for block in range(info.n_layer)]


def embd_and_expert_ff(info: ModelInfo) -> tuple[int, int]:
    """The model's embedding width and a routed expert's hidden width (the FFN's where the header
    names no expert width, else four times the embedding)."""
    md, arch = info.metadata, info.arch
    n_embd = scalar_or_max(md.get(f"{arch}.embedding_length")) or 0
    return n_embd, info.expert_ff or scalar_or_max(md.get(f"{arch}.feed_forward_length")) or 4 * n_embd


def compute_buffer_bytes(info: ModelInfo, ubatch: int = DEFAULT_UBATCH) -> int:
    """The graph's scratch memory for one ubatch: its largest live tensors are the logits and the
    expert activations. An estimate on the high side of what llama-server logs as its compute
    buffer size (checked in tests/test_plan.py)."""
    n_vocab = max(vocab_size(info), 32000)  # a floor that covers a tiny model's other buffers
    n_embd, n_ff = embd_and_expert_ff(info)
    per_token = n_vocab + 4 * n_embd + 3 * info.n_expert_used * n_ff + info.n_expert
    return 4 * ubatch * per_token


def expert_copy_ahead_bytes(info: ModelInfo, layers: list[MoeLayer] | None = None) -> int:
    """What the compute buffer holds beyond stock's when the expert cache is on and experts stay in
    RAM: for a prompt batch the scheduler copies a layer's gate and down weights while the split before
    computes (native patch 0021), so two copies of an expert weight are live where stock holds one.
    The largest expert weight (3-D) of any MoE layer; twice that where the experts have biases
    (gpt-oss): each expert matmul is followed by a bias add, a split of its own, and the copy, queued
    at the layer's previous expert split (patch 0021), stays live across it. On top of moeplug's own
    compute estimate (no GPU to ask llama.cpp: one GPU, or each of two); beside llama.cpp's, see
    cache_compute_extra. layers: those whose prompt batches copy ahead (default: every MoE layer)."""
    layers = info.layers if layers is None else layers
    largest = largest_expert_weight(layers)
    biased = any(key.endswith("_exps.bias") for layer in layers for key in layer.tensors)
    return 2 * largest if biased else largest


def expert_side_bytes(layers: list[MoeLayer]) -> int:
    """Bytes of the experts' small tensors beside their weights (biases, scales: 2-D, one row per
    expert) in these layers: where the GPU computes some misses (--moe-cache-stream), it reads them
    from full copies in VRAM, so that no small host copy syncs it with the CPU mid-layer."""
    return sum(t.n_bytes for layer in layers for t in layer.tensors.values() if len(t.shape) < 3)


def largest_expert_weight(layers: list[MoeLayer]) -> int:
    """Bytes of the largest expert weight (3-D, every expert of one layer) among these layers."""
    return max((t.n_bytes for layer in layers for t in layer.tensors.values() if len(t.shape) == 3), default=0)


def vocab_size(info: ModelInfo) -> int:
    """Tokens of the vocabulary: the rows of the token embeddings (model_inspect skips the tokenizer's
    arrays), else the output matrix's, else {arch}.vocab_size, else 32000."""
    for name in ("token_embd.weight", "output.weight"):
        t = next((t for t in info.tensors if t.name == name and len(t.shape) == 2), None)
        if t is not None:
            return t.shape[1]
    return scalar_or_max(info.metadata.get(f"{info.arch}.vocab_size")) or 32000


def logits_bytes(info: ModelInfo, ubatch: int = DEFAULT_UBATCH) -> int:
    """f32 logits over the whole vocabulary for every token of a ubatch."""
    return 4 * ubatch * vocab_size(info)


def cache_compute_extra(info: ModelInfo, extra: int) -> int:
    """What the cache adds to llama.cpp's own compute estimate (fit_estimate.gpu_need, asked with
    every expert in RAM). That figure is sized for a ubatch of logits over the whole vocabulary,
    which the server never holds while it copies expert weights; the cache's graph measured `extra`
    above it (fit_estimate.CACHE_COMPUTE_EXTRA) where a weight copy and the copies ahead stay below
    those logits (both benchmark shapes), and gets whatever they outgrow them by where they do not."""
    copies = largest_expert_weight(info.layers) + expert_copy_ahead_bytes(info)
    return max(extra, copies - logits_bytes(info))


def cache_compute_single_copy(info: ModelInfo, extra: int) -> int:
    """What the cache adds to llama.cpp's own compute estimate when prompt batches copy their expert
    weights one at a time (no copies ahead), negative where it takes away: that estimate is sized
    for a ubatch of logits, which the server never holds while it copies a weight; what it holds is
    about the estimate less those logits, plus one expert weight copy and the cache's graph `extra`.
    Measured (run 2026-12-02-copy-ahead-vs-slots): planned 175 MiB, logged 172 on the Qwen3 shape (316 - 297 + 108 +
    48); planned 206 (231 with the 25 MiB of biases a streaming plan mirrors), logged 203 on the
    gpt-oss shape. Never more than with the copies ahead."""
    single = largest_expert_weight(info.layers) + extra - logits_bytes(info)
    return min(single, cache_compute_extra(info, extra))




def ubatch_growth_bytes(info: ModelInfo, ubatch: int, costs: CostModel = DEFAULT_COSTS) -> int:
    """What a server on a GPU holds beyond llama.cpp's own estimate at its default ubatch (512) when it
    runs prompt batches of `ubatch` tokens; nothing at 512 or less (llama.cpp's estimate then counts
    a ubatch of logits the server does not hold, left as headroom). llama.cpp's estimate asked at the
    larger ubatch counts that many more logits instead: 890 MiB more at 2048 on the Qwen3 shape, which
    the servers did not hold."""
    n_embd, n_ff = embd_and_expert_ff(info)
    per_token = 4 * info.n_expert_used * 2 * (n_ff + n_embd)
    return int(costs.ubatch_growth_factor * max(0, ubatch - DEFAULT_UBATCH) * per_token)


def bytes_per_slot(info: ModelInfo) -> int:
    """One expert of every MoE layer."""
    return sum(layer.bytes_per_expert for layer in info.layers)


def stock_ncmoe(info: ModelInfo, room: int) -> int:
    """The lowest -ncmoe K (experts of blocks < K in RAM) whose GPU experts fit in room bytes."""
    for k in range(info.n_layer + 1):
        if sum(layer.expert_bytes for layer in info.layers if layer.block >= k) <= room:
            return k
    return info.n_layer


def whole_layers_first(info: ModelInfo, room: int, layers: list[MoeLayer] | None = None) -> list[int]:
    """Stock placement without a profile: whole layers from the first while they fit in room bytes,
    the experts of the rest in RAM (the same bytes as -ncmoe, the other end: see experts_in_ram_args).
    layers: these MoE layers only (one GPU's), default all of them."""
    layers = info.layers if layers is None else layers
    slots, used = [0] * len(layers), 0
    for i, layer in enumerate(layers):
        if used + layer.expert_bytes > room:
            break  # one run of whole layers, as stock keeps them
        slots[i] = info.n_expert
        used += layer.expert_bytes
    return slots


def choose_load_mode(info: ModelInfo, ram_available: int | None) -> tuple[str, list[str]]:
    """Pinned host memory (-lm none) made stock prefill 7x faster than mmap with experts in RAM on
    the GPU machine (shared/reference/baseline-h200.md); it needs the experts to fit in free RAM."""
    if ram_available is None:
        return "mmap", ["free RAM unknown: loading with mmap"]
    if ram_available > 1.1 * info.total_bytes:
        return "pinned", []
    return "mmap", [f"{ram_available / GIB:.1f} GiB RAM free for a {info.total_bytes / GIB:.1f} GiB model: "
                    f"mmap (pinned memory would make prefill much faster)"]
