"""llama-server flags for a placement: which blocks keep their experts in RAM, and the slot cache.

Whole layers load straight into VRAM like any offloaded layer; `-ot` keeps the other layers'
routed experts in RAM; `--moe-cache-slots` gives counts to the partly resident layers only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moeplug.core.sizes import MIB
from moeplug.planner.estimates import DEFAULT_BATCH, DEFAULT_UBATCH
from moeplug.model.inspect import ModelInfo
from moeplug.profile.format import Profile

# the dynamic policy's settings moeplug serves with: a use count halves every 32 tokens and up to 8
# uploads start after a batch (llama.cpp's defaults are 128 and 4). On the gpt-oss-20b trace
# (planner fed prompts 0:400, 24 held-out requests of 64 prompt + 64 generated tokens, the
# engine's rule simulated in Python) the slots served 52.7% of selections at 25% of the expert
# bytes (static 46.7%, 128/4 51.6%) and 80.5% at 50% (static 76.9%, 128/4 79.7%): DESIGN.md.
def dynamic_args(uploads: int = 8) -> list[str]:
    """The dynamic policy's flags with `uploads` started after a batch (CostModel.dynamic_uploads)."""
    return ["--moe-cache-policy", "dynamic", "--moe-cache-half-life", "32", "--moe-cache-uploads", str(uploads)]


DYNAMIC_ARGS = dynamic_args()
# prompt batches of N tokens or more go to the GPU for the layers whose GPU copies their experts from the
# slots (native patch 0025); llama.cpp's own threshold, GGML_OP_OFFLOAD_MIN_BATCH (32), applies to
# every model of a process, this flag to one model and to its cache's layers alone
OFFLOAD_MIN_BATCH_FLAG = "--moe-cache-offload-min-batch"
COPY_AHEAD_FLAG = "--moe-cache-copy-ahead"  # on|off: a prompt batch's expert copies on a second queue
DEVICE_FLAG = "--moe-cache-device"  # CPU: the slots in RAM (the demo's stand-in for a GPU)
SLOTS_IN_RAM_ARGS = [DEVICE_FLAG, "CPU"]


def env_of(args: list[str]) -> dict[str, str]:
    """The LLAMA_ARG_* environment that stands for llama-server flags of the --moe-cache-NAME VALUE form."""
    return {"LLAMA_ARG_" + flag.removeprefix("--").replace("-", "_").upper(): value
            for flag, value in zip(args[::2], args[1::2])}


def with_threads(args: list[str], threads: int | None) -> list[str]:
    """Server args with their CPU thread count replaced: None keeps it, 0 drops it (llama.cpp's
    default, a thread per physical core), N sets -t N."""
    if threads is None:
        return list(args)
    out, i = [], 0
    while i < len(args):
        if args[i] in ("-t", "--threads"):
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out + (["-t", str(threads)] if threads else [])


# llama.cpp's own pattern for the routed-expert tensors of a block (common.h, LLM_FFN_EXPS_REGEX)
_EXPS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def experts_in_ram_args(blocks: list[int]) -> list[str]:
    """-ot keeping the routed experts of these blocks in RAM, as stock -ncmoe does for the first K:
    any set of blocks, so that the last layers can be the ones in RAM (stock --fit's choice, whose
    prefill beat -ncmoe's first layers on the GPU machine: native/README.md has the numbers)."""
    if not blocks:
        return []
    return ["-ot", rf"blk\.({'|'.join(str(b) for b in sorted(blocks))}){_EXPS_PATTERN}=CPU"]


def _slots_arg(info: ModelInfo, profile: Profile, slots: list[int]) -> str:
    """--moe-cache-slots: one count, or one per layer in the profile's layer order."""
    if len(set(slots)) == 1:
        return str(slots[0])
    by_block = {layer.block: n for layer, n in zip(info.layers, slots)}
    return ",".join(str(by_block.get(int(t.split(".")[1]), 0)) for t in profile.tensors)


def placement_args(info: ModelInfo, slots: list[int], profile: Profile | None, profile_path: Path | None,
                   policy: str = "static", ubatch: int = DEFAULT_UBATCH, uploads: int = 8) -> list[str]:
    """llama-server flags (beside -ngl 99) for slots per MoE layer in block order. Whole
    layers load straight into VRAM like any offloaded layer (no copy of them stays in RAM); the
    others keep their experts in RAM, and the cache holds the slots of the partly resident ones
    (policy "dynamic": they follow the prompt, --moe-cache-policy dynamic, `uploads` started after a
    batch). ubatch: the server's -ub."""
    in_ram = [layer.block for layer, n in zip(info.layers, slots) if n < info.n_expert]
    partial = [n if n < info.n_expert else 0 for n in slots]
    args = experts_in_ram_args(in_ram)
    if profile is not None and any(partial):
        args += ["--moe-cache-slots", _slots_arg(info, profile, partial), "--moe-cache-profile", str(profile_path)]
        # on CUDA with pinned weights a prompt batch runs the stock pass, its experts copied on the
        # GPU from the slots; where that cannot engage, every batch through the two passes: above the
        # max batch the stock graph would upload the resident experts too
        args += ["--moe-cache-max-batch", str(ubatch)]
        if policy == "dynamic":
            args += dynamic_args(uploads)
    return args


def ubatch_args(ubatch: int) -> list[str]:
    """llama-server's batch flags for a physical batch of `ubatch` prompt tokens (none for its default):
    the logical batch (-b) at least as large, as llama.cpp requires."""
    if ubatch == DEFAULT_UBATCH:
        return []
    return ["-b", str(max(ubatch, DEFAULT_BATCH)), "-ub", str(ubatch)]


def fit_target(budget: int | list[int] | None, free: list[int]) -> str:
    """stock's -fitt from each GPU's free bytes: MiB to leave free, so that the budget is what stock may
    use there (per GPU for a list of budgets, 0 for one without a GPU; 0 without a budget or a GPU)."""
    if budget is None:
        return "0"
    if not isinstance(budget, list):
        return str(max(0, (free[0] - budget) // MIB)) if free else "0"
    padded: list[int | None] = [*free, *[None] * len(budget)]
    return ",".join(str(max(0, (f - b) // MIB)) if f is not None else "0" for f, b in zip(padded, budget))


def stock_args(plan: Any, free: list[int] | None = None, stock_ubatch: int | None = None) -> list[str]:
    """Stock llama-server as users run it at a plan's budget, its flags beside the model: --fit with each
    GPU's free bytes (`free`) less the budget left over (-fitt, fit_target), the plan's context and load
    mode, llama.cpp's prompt batch unless given. What `moeplug bench` compares with, and what a model
    is served with where the install's check found the plan slower (operations.check). free None:
    the GPUs' free memory now (machine.gpu). With remote devices (machine.rpc): the same --rpc, and
    each remote device's free memory when planned less its budget."""
    if free is None:
        from moeplug.machine.gpu import gpus

        free = [g.free_bytes for g in gpus()]
    load = ["-lm", "none"] if plan.load_mode == "pinned" else []
    budget, remote = plan.vram_budget_bytes, []
    if plan.devices and any(d.endpoint for d in plan.devices):  # remote devices first, as llama.cpp orders them
        remote = [d for d in plan.devices if d.endpoint]
        budget = [d.budget_bytes for d in plan.devices]
        free = [d.free_bytes if d.free_bytes is not None else d.budget_bytes for d in remote] + free
    rpc = ["--rpc", ",".join(dict.fromkeys(str(d.endpoint) for d in remote))] if remote else []
    return [*rpc, "-c", str(plan.ctx), "--fit", "on", "-fitt", fit_target(budget, free), *load,
            *ubatch_args(stock_ubatch or DEFAULT_UBATCH)]
