"""The planner's cost model: every figure fitted to measurements, in one typed record.

The planner weighs placements by modelled host time (allocate.py) and sizes the GPU's buffers from
llama.cpp's own figures plus what they miss (estimates.py, fit_estimate.py, speculation.py). Each
figure below was fitted to runs through llama-server on one machine, the GPU machine (an H200 on
PCIe 5, 16 CPU cores, DDR5): `DEFAULT_COSTS` holds them and is what plans use where nothing measured
this machine. A field's comment says what it means and the run it comes from (the run's folder under
native/bench/results/ and its entry in native/BENCHMARKS.md); the derivation lives there, not here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from moeplug.core.sizes import MIB

GPU_MACHINE = "the GPU machine (H200 on PCIe 5, 16 cores): fitted figures"


@dataclass(frozen=True)
class CostModel:
    # --- decode: a layer with experts in RAM, per decoded token (run 2026-11-30-llama-bench) ---
    cpu_expert_bytes_per_s: float = 63e9  # expert bytes the CPU computes per second, at the server's threads
    round_trip_s: float = 60e-6  # a layer's activations to the CPU and its result back
    slot_pass_s: float = 20e-6  # a partly resident layer's extra pass over its slots on the GPU
    # --- prompt batches: missed experts uploaded per batch (run 2026-12-02-server-rounds-vram) ---
    upload_bytes_per_s: float = 70e9  # the cache's path: copies on the GPU, the next weights while one computes
    stock_upload_bytes_per_s: float = 48e9  # stock's path: one weight after another from pinned RAM
    # long prompts: a batch of hundreds of tokens picks nearly every expert, bound by the bus on either
    # path (run 2026-12-03-ubatch-auto)
    long_prompt_upload_bytes_per_s: float = 43e9
    # the bus: pinned host-to-GPU copies (the GPU machine's: 55.5 GB/s over 1 GiB buffers);
    # the upload and streaming figures above and below were fitted at this rate and scale with it
    h2d_bytes_per_s: float = 55.5e9
    # --- misses computed by the GPU from pinned RAM beside the CPU (run 2026-12-02-stream-share) ---
    stream_cpu_scale: float = 1.34  # the CPU's misses took this times the decode model above (MXFP4 experts)
    stream_gpu_ratio: float = 0.56  # the GPU's share took this share of the CPU's time for the same experts
    stream_layer_s: float = 159e-6  # every streamed layer, per step
    # --- memory beside the experts ---
    safety_margin: int = 512 * MIB  # left free on the GPU where moeplug estimates the buffers itself
    cuda_pool_headroom: int = 256 * MIB  # CUDA's memory pool beyond the compute buffer (own estimate)
    # the CUDA runtime's own memory in a server process, which no ggml buffer counts: NVML less the
    # logged buffers, 701-742 MiB over the servers of runs 2026-12-02-server-rounds-vram and
    # 2026-12-03-cpu-overlap, rounded up
    cuda_context_reserve: int = 748 * MIB
    # the cache's graph beyond llama-fit-params' compute figure where whole-ubatch logits dominate it
    # (run 2026-12-02-server-rounds-vram: 449 against 416 MiB on gpt-oss, 356 against 316 on Qwen3)
    cache_compute_extra: int = 48 * MIB
    # what each prompt token of a ubatch beyond 512 adds, in units of a token's routed activations
    # (run 2026-12-03-long-prompts-ubatch)
    ubatch_growth_factor: float = 1.05
    # a draft context on the GPU beyond llama.cpp's compute figure less its logits
    # (run 2026-12-02-server-rounds-vram)
    draft_context_extra: int = 192 * MIB
    # --- rules fitted to runs: where a lever pays ---
    # a prompt batch's guard: differences in modelled prefill below this are not resolved by a run
    # (run 2026-12-03-ubatch-auto)
    prefill_guard_tolerance: float = 0.02
    stream_min_saving: float = 0.10  # stream misses only where it saves this share of the host time
    ubatch_min_gain: float = 0.05  # a larger prompt batch only where modelled this much faster (2026-12-03-ubatch-auto)
    # at or below this share of partly resident MoE layers, the copies ahead cost more than the slots
    # their memory holds (run 2026-12-02-copy-ahead-vs-slots)
    copy_ahead_few_partial: float = 0.25
    # at or below this share of partly resident layers, half the cores serve better than all, on
    # machines of server_threads_min_cores or more (runs 2026-12-03-timeline-threads, 2026-12-03-threads-rule)
    server_threads_few_partial: float = 0.25
    server_threads_min_cores: int = 8
    # the dynamic policy's uploads started after a batch (--moe-cache-uploads; fitted on the gpt-oss-20b
    # trace at this bus: native/DESIGN.md, "Slots that follow the prompt"); fewer on a slower bus, and
    # 0: the static policy
    dynamic_uploads: int = 8
    # prompt batches of this many tokens or more go to the GPU with their misses copied over, where
    # llama.cpp sends batches below 32 tokens to the CPU (run 2026-12-04-short-prompts-gpu)
    short_prompt_offload: int = 8
    # a remote device (llama.cpp's RPC backend): a step's activations to its host and back, for each run
    # of its layers and each of its layers computed partly here. Not measured on the GPU machine: a
    # gigabit LAN's round trip with a few KB each way, taken high; `moeplug calibrate --rpc` measures it
    rpc_hop_s: float = 1e-3
    # where the figures come from: GPU_MACHINE, or a calibration of this machine
    source: str = GPU_MACHINE

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_measured(cls, cpu_expert_bytes_per_s: float, h2d_bytes_per_s: float | None = None,
                      round_trip_s: float | None = None, prompt_upload_bytes_per_s: float | None = None,
                      gpu_miss_bytes_per_s: float | None = None, rpc_hop_s: float | None = None,
                      source: str = "measured") -> CostModel:
        """The cost model of a machine from what was measured there (operations.calibrate), the GPU
        machine's figures for the rest. What the bus carries scales with the bus: the prompt batches'
        upload rates (unless stock's prompt path was measured, prompt_upload_bytes_per_s: the cache's
        path then in the GPU machine's proportion to it) and the GPU's time on streamed
        misses (unless its rate on misses read from host memory was measured), and the dynamic policy
        starts fewer uploads a batch, none below an eighth of the GPU machine's bus (the slots then
        stay as profiled: the static policy). A figure not measured (None) keeps the default."""
        d = DEFAULT_COSTS
        bus = h2d_bytes_per_s or d.h2d_bytes_per_s
        scale = bus / d.h2d_bytes_per_s
        stock_upload = prompt_upload_bytes_per_s or d.stock_upload_bytes_per_s * scale
        # the GPU's time per streamed byte, fitted on the GPU machine as a share of its CPU's
        gpu_s_per_byte = (1.0 / gpu_miss_bytes_per_s if gpu_miss_bytes_per_s else
                          d.stream_gpu_ratio * d.stream_cpu_scale / d.cpu_expert_bytes_per_s / scale)
        cpu_s_per_byte = d.stream_cpu_scale / cpu_expert_bytes_per_s
        return replace(d, cpu_expert_bytes_per_s=cpu_expert_bytes_per_s, h2d_bytes_per_s=bus,
                       round_trip_s=round_trip_s if round_trip_s is not None else d.round_trip_s,
                       upload_bytes_per_s=d.upload_bytes_per_s * stock_upload / d.stock_upload_bytes_per_s,
                       stock_upload_bytes_per_s=stock_upload,
                       long_prompt_upload_bytes_per_s=d.long_prompt_upload_bytes_per_s * scale,
                       stream_gpu_ratio=gpu_s_per_byte / cpu_s_per_byte,
                       dynamic_uploads=uploads_at(d.dynamic_uploads, scale),
                       rpc_hop_s=rpc_hop_s if rpc_hop_s is not None else d.rpc_hop_s, source=source)

    def describe(self) -> str:
        """One line for the plan's table: where the figures come from and the ones a machine changes most."""
        return (f"{self.source}: CPU {self.cpu_expert_bytes_per_s / 1e9:.3g} GB/s of experts, bus "
                f"{self.h2d_bytes_per_s / 1e9:.3g} GB/s, round trip {self.round_trip_s * 1e6:.0f} us")

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CostModel:
        """The record as to_json wrote it; keys it does not know are dropped, ones it lacks keep
        the GPU machine's figures."""
        known = {f.name for f in fields(cls)}
        return replace(DEFAULT_COSTS, **{k: v for k, v in doc.items() if k in known})


DEFAULT_COSTS = CostModel()


def uploads_at(uploads: int, scale: float) -> int:
    """The dynamic policy's uploads a batch on a bus `scale` times the GPU machine's: as many fewer,
    and none (the static policy) where not even one would take its share of the bus."""
    return min(uploads, round(uploads * scale)) if uploads * scale >= 1 else 0
