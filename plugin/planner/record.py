"""The plan: one typed record of what the planner chose for a model on a machine, and why.

It is what `moeplug plan` prints, what the installed model stores (serving.installed), what the
server is launched with (`server_args`, `server_env()`), and what status, the hooks and the dashboard
read. Versioned by the planner's revision (`planner`, PLANNER_REVISION): a record an older planner
made is read (from_json: unknown keys dropped, missing ones defaulted) and re-planned where it is
served (operations.install.up_to_date).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from moeplug.machine.backend import Backend, backend as backend_of
from moeplug.planner.allocate import PREFILL_WEIGHT
from moeplug.planner.estimates import DEFAULT_UBATCH
from moeplug.planner.multi_gpu import DevicePlan
from moeplug.planner.request import UBATCH_AUTO

# raised when a change to the planner makes the plans it stored before worth making again: `moeplug serve`,
# `moeplug bench` and the hooks re-plan an installed model whose plan an older revision made, from its
# stored budget, context and choices (install.up_to_date; 1: the threads halved only where few layers are
# partly resident; 2: short prompt batches on the GPU, CostModel.short_prompt_offload; 3: the same through
# the server's flag, not its environment; 4: the copies ahead switched off by the flag --moe-cache-copy-ahead, not
# the environment)
PLANNER_REVISION = 4


@dataclass
class Plan:
    model: str
    backend: Backend  # the build it runs on: CPU (no GPU), CUDA or Vulkan
    ctx: int
    vram_budget_bytes: int | None
    non_expert_vram_bytes: int
    kv_cache_bytes: int
    compute_bytes: int
    margin_bytes: int
    bytes_per_slot: int
    n_expert: int
    n_moe_layers: int
    slots_per_layer: list[int]  # per MoE layer, in block order
    slots_total: int
    whole_layers: int  # layers with every expert resident: no CPU pass
    expert_vram_bytes: int
    fit_fraction: float
    predicted_hit_rate: float | None
    stock_ncmoe: int | None
    modelled_host_ms: float | None  # host-side time per decoded token, prompts weighted (allocate.py's model)
    stock_modelled_host_ms: float | None  # the same for stock --fit's placement at this budget (the first layers whole)
    load_mode: str
    profile: str | None
    server_args: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cache_policy: str = "static"  # "dynamic": the slots follow the prompt (--moe-cache-policy dynamic)
    vram_source: str = "estimate"  # what sized the GPU's other buffers: "estimate" (estimates.py) or "llama-fit-params"
    # two GPUs only (absent from a one-GPU plan's JSON): per GPU what it holds (multi_gpu.DevicePlan's
    # JSON), and the --tensor-split proportions; the figures above are then the sums over the GPUs
    devices: list[DevicePlan] | None = None
    tensor_split: list[int] | None = None
    # speculative decoding (speculation.py): Speculation.to_json(), or None; what its draft holds on
    # the GPU (an MTP head: its NextN blocks, experts included; two GPUs: summed over them); the
    # slots were spread for batches of tokens_per_step tokens, and modelled_host_ms is per such
    # verification step
    speculation: dict[str, Any] | None = None
    draft_weights_bytes: int = 0
    draft_kv_cache_bytes: int = 0
    draft_compute_bytes: int = 0
    tokens_per_step: int = 1
    # prompt tokens per generated token the slots were spread for (allocate.py: prompt batches)
    prefill_weight: float = PREFILL_WEIGHT
    # what the layers not whole add to a prompt batch per prompt token (allocate.py's model), for these
    # slots and for stock's placement; None without prompt tokens in the profile
    modelled_prompt_us: float | None = None
    stock_modelled_prompt_us: float | None = None
    # how many times more prompt batches were weighed to keep them at stock's (allocate_against_stock)
    prefill_guard: float = 1.0
    # the share of the partly resident layers' misses the GPU computes beside the CPU (--moe-cache-stream;
    # allocate.stream_share), 0 for none, and what it is modelled to save per step
    stream_share: float = 0.0
    modelled_stream_saving_ms: float = 0.0
    # whether a prompt batch's later expert weights are copied while the split before computes (native
    # patch 0021, on by default); off, the compute buffer holds one weight copy as stock's does and the
    # bytes go to slots (the server then runs with --moe-cache-copy-ahead off)
    copy_ahead: bool = True
    # prompt batches of this many tokens or more go to the GPU with their missed experts copied over
    # (--moe-cache-offload-min-batch in server_args; CostModel.short_prompt_offload), None for llama.cpp's
    # (estimates.MIN_UBATCH): set where the cache holds slots on one GPU
    offload_min_batch: int | None = None
    # the server's CPU threads (-t), None for llama.cpp's default (plan.server_threads); threads_asked:
    # what the user asked for (0: llama.cpp's default), None for the planner's choice (kept on re-plans)
    threads: int | None = None
    threads_asked: int | None = None
    # the planner's revision that made it (PLANNER_REVISION); 0: a record from before revisions
    planner: int = 0
    # the server's physical batch (-ub; make_plan): llama.cpp's 512 unless the user asked for another or the
    # planner chose a larger one for long prompts; ubatch_asked: what the user asked for, UBATCH_AUTO for the
    # planner's choice (kept on re-plans); prompt_tokens: the prompt length prompt batches were planned for,
    # None for the profile's own prompts (kept on re-plans)
    ubatch: int = DEFAULT_UBATCH
    ubatch_asked: int = UBATCH_AUTO
    prompt_tokens: int | None = None
    # the served traffic prefill_weight and prompt_tokens were learned from (moeplug reprofile:
    # traffic.Traffic.to_json()), kept on re-plans that do not set them; None: the user's or the defaults
    workload: dict[str, Any] | None = None
    # the cost model the plan was made with (CostModel.to_json()) where it is not the GPU machine's
    # fitted figures (a calibration of this machine, or a file given by hand); absent from the JSON otherwise
    cost_model: dict[str, Any] | None = None
    # the environment the server needs to see the plan's GPU (machine.devices: a software Vulkan device named
    # by index), beside server_env's own
    device_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.backend = backend_of(self.backend)

    @property
    def workload_source(self) -> str:
        """Where prefill_weight and prompt_tokens came from: "learned" (the served traffic, `workload`),
        "asked" (set by hand: values other than the defaults) or "default"."""
        if self.workload:
            return "learned"
        return "asked" if self.prefill_weight != PREFILL_WEIGHT or self.prompt_tokens else "default"

    def server_env(self) -> dict[str, str]:
        """The environment the plan's server runs with beside its flags: the machine's device switches
        alone (the same for every model on it); every choice of the plan is a flag."""
        return dict(self.device_env)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self) | {"backend": self.backend.value}
        for key in ("devices", "tensor_split", "cost_model"):
            if doc[key] is None:
                del doc[key]
        if not doc["device_env"]:
            del doc["device_env"]
        if self.devices:
            doc["devices"] = [d.to_json() for d in self.devices]
        return doc

    @property
    def budget(self) -> int | list[int] | None:
        """The budget it was planned for, as make_plan takes it: one per GPU where it has two."""
        return [d.budget_bytes for d in self.devices] if self.devices else self.vram_budget_bytes

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Plan:
        """A plan as to_json wrote it (an installed record); keys it does not know are dropped,
        required ones it lacks (an older record) are None."""
        known = fields(cls)
        values: dict[str, Any] = {f.name: None for f in known if f.default is MISSING and f.default_factory is MISSING}
        values.update({f.name: doc[f.name] for f in known if f.name in doc})
        if values.get("devices"):
            values["devices"] = [DevicePlan.from_json(d) for d in values["devices"]]
        if "ubatch_asked" not in doc and doc.get("ubatch", DEFAULT_UBATCH) != DEFAULT_UBATCH:
            # a record from before --ubatch auto: a ubatch other than 512 was asked for
            values["ubatch_asked"] = doc["ubatch"]
        return cls(**values)


def outdated(plan: Plan) -> bool:
    """Whether an older revision of the planner made this plan (PLANNER_REVISION)."""
    return plan.planner < PLANNER_REVISION


def describe_slots(slots_per_layer: list[int] | int, n_expert: int) -> str:
    """'8 of 8 per layer', or '0-128 of 128 per layer (31 whole layers)' (an int: older plans)."""
    slots = [slots_per_layer] if isinstance(slots_per_layer, int) else slots_per_layer
    lo, hi = min(slots, default=0), max(slots, default=0)
    span = f"{hi}" if lo == hi else f"{lo}-{hi}"
    whole = sum(n >= n_expert for n in slots)
    plural = "s" if whole != 1 else ""
    return f"{span} of {n_expert} per layer" + (f" ({whole} whole layer{plural})" if whole and lo != hi else "")


def describe_blocks(blocks: list[int], output: bool = False) -> str:
    """A device's blocks (a contiguous run, as llama.cpp's layer split gives them): '0', '1-3' or
    'none'; ' + output' where it holds the output layer."""
    held = "none" if not blocks else str(blocks[0]) if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
    return held + (" + output" if output else "")
