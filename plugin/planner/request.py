"""What the planner is asked and what it knows of the machine: two typed records in, one plan out.

`PlanRequest` is the user's choices (budget, context, speculation, the workload, threads, prompt
batch); it is stored with the installed model beside its plan, so a re-plan starts from what was
asked, not from what the last plan made of it. `MachineFacts` is what this machine has (GPUs, free
RAM, cores, llama.cpp's own figure for the GPU's other buffers) and what its work costs
(`CostModel`), probed once per command (operations.install.probe_machine) or set by hand (tests,
benchmarks, planning for another machine).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.machine.backend import Backend
from moeplug.machine.rpc import RemoteDevice
from moeplug.planner.allocate import PREFILL_WEIGHT
from moeplug.planner.costs import DEFAULT_COSTS, CostModel
from moeplug.planner.estimates import MIN_UBATCH
from moeplug.planner.fit_estimate import DeviceNeed
from moeplug.planner.speculation import KeepInstalled, Speculation

# the planner's choice of the server's prompt batch (-ub): PlanRequest.ubatch's value for "auto"
UBATCH_AUTO = 0
POLICIES = ("auto", "static", "dynamic")
# the figures a plan is made with (PlanRequest.costs): this machine's (a calibration file named, else its own
# calibration, else the fitted ones), or the fitted figures whatever was measured, where the install's check
# found the plan made with them the faster one here (operations.check)
COSTS_MACHINE, COSTS_FITTED = "machine", "fitted"
COSTS = (COSTS_MACHINE, COSTS_FITTED)


@dataclass(frozen=True)
class PlanRequest:
    """The user's choices for one model's plan. Where a field is the planner's to choose, its value
    says so (copy_ahead None, threads None, ubatch UBATCH_AUTO, prompt_tokens None)."""

    ctx: int
    # bytes of one GPU's budget, or one per GPU; None: no GPU to plan for (a CPU plan)
    vram_budget: int | list[int] | None = None
    policy: str = "auto"  # the slot policy: "static", "dynamic", or "auto" (dynamic where a layer is partly resident)
    spec: Speculation | None = None
    prefill_weight: float = PREFILL_WEIGHT  # prompt tokens per generated token (0: decode only)
    copy_ahead: bool | None = None  # prompt batches copy their next weights ahead (None: the planner's choice)
    threads: int | None = None  # the server's -t (0: llama.cpp's default; None: the planner's choice)
    ubatch: int = UBATCH_AUTO  # the server's -ub (UBATCH_AUTO: the planner's choice)
    prompt_tokens: int | None = None  # the prompt length prompt batches are planned for (None: the profile's)
    # the demo's slots per layer, whatever the cost model says: without a GPU held in RAM (its stand-in for a GPU),
    # with one on it
    slots_in_ram: int = 0
    # the served traffic prefill_weight and prompt_tokens were learned from (serving.traffic), or None
    workload: dict[str, Any] | None = None
    # a calibration file to plan with (a machine's measured costs: operations.calibrate), or None: this
    # machine's own calibration where it has one, else the GPU machine's figures
    calibration: str | None = None
    # remote devices: the rpc-servers (HOST:PORT, machine.rpc) whose devices hold layers, and a budget
    # per remote device in llama.cpp's order (None: each device's free memory)
    rpc: tuple[str, ...] = ()
    rpc_budget: list[int] | None = None
    costs: str = COSTS_MACHINE  # COSTS

    def check(self) -> None:
        """The one-line errors for choices no plan can take."""
        if self.ubatch != UBATCH_AUTO and self.ubatch < MIN_UBATCH:
            raise MoeplugError(f"--ubatch {self.ubatch}: at least {MIN_UBATCH} (a prompt batch below it is not "
                               f"offloaded)")
        if self.prompt_tokens is not None and self.prompt_tokens < 0:
            raise MoeplugError(f"--prompt-tokens {self.prompt_tokens}: 0 or more")
        if self.policy not in POLICIES:
            raise MoeplugError(f"slot policy {self.policy!r}: one of {', '.join(POLICIES)}")
        if self.costs not in COSTS:
            raise MoeplugError(f"costs {self.costs!r}: one of {', '.join(COSTS)}")
        if self.rpc_budget and not self.rpc:
            raise MoeplugError("--rpc-budget: there is no --rpc host to give budgets to")
        if self.rpc and self.spec is not None and self.spec.kind != "ngram":
            raise MoeplugError(f"--spec {self.spec.kind} with --rpc: a draft's share on remote devices is not planned "
                               f"yet; --spec ngram, or no --rpc")

    def given(self, **changes: Any) -> PlanRequest:
        """This request with the choices given now (None: not given, this request's stands). Setting
        prefill_weight or prompt_tokens by hand drops the workload they were learned from, unless a
        new one comes with them."""
        given = {k: v for k, v in changes.items() if v is not None}
        if ("prefill_weight" in given or "prompt_tokens" in given) and "workload" not in given:
            given["workload"] = None
        return replace(self, **given)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self) | {"spec": self.spec.to_json() if self.spec else None, "rpc": list(self.rpc)}
        left_out = (() if self.rpc else ("rpc", "rpc_budget")) + (() if self.costs != COSTS_MACHINE else ("costs",))
        return {k: v for k, v in doc.items() if k not in left_out}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PlanRequest:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        return cls(**(values | {"spec": Speculation.from_json(doc.get("spec")), "rpc": tuple(doc.get("rpc") or ())}))


@dataclass(frozen=True)
class MachineFacts:
    """What the planner knows of the machine it plans for."""

    ram_available: int | None = None  # bytes of RAM free now (None: unknown, pinned memory assumed to fit)
    cpu_cores: int | None = None  # physical cores the server may use (probes.usable_cores)
    # llama.cpp's own figure (llama-fit-params) for what one GPU holds beside the routed experts, and
    # for a speculative draft model; None: moeplug's estimate (estimates.py)
    need: DeviceNeed | None = None
    draft_need: DeviceNeed | None = None
    expert_room: int | None = None  # VRAM for the experts where measured better than any estimate (benchmarks)
    costs: CostModel = DEFAULT_COSTS
    notes: tuple[str, ...] = ()  # what the probe has to say in the plan (e.g. one budget for two GPUs)
    remote: tuple[RemoteDevice, ...] = ()  # the devices of the request's rpc-servers (machine.rpc), in order
    # the backend of the build the plan's GPU runs (what its GPU paths can do: machine.backend)
    backend: Backend = Backend.CUDA
    # whether the server may rely on pinned host memory (False under WSL2, which caps it near 1 GiB, or where a
    # server's log showed it refused: machine.probes.pinned_refusal), and why not
    pinned: bool = True
    pinned_note: str = ""
    # what the server needs to see the GPU planned for (machine.devices: a software Vulkan device named by index)
    device_env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PlanChoices:
    """The plan choices given on a command line, for a model installed or not: None (and spec
    KeepInstalled()) where not given, so that an installed model's own stand (PlanRequest.given), else
    the planner's defaults."""

    vram_budget: int | list[int] | None = None
    ctx: int | None = None
    ctx_override: bool = False  # a context above the model's training context is allowed
    spec: Speculation | KeepInstalled | None = KeepInstalled()
    prefill_weight: float | None = None
    threads: int | None = None
    ubatch: int | None = None
    prompt_tokens: int | None = None
    calibration: str | None = None
    rpc: tuple[str, ...] | None = None  # () drops an installed model's remote devices
    rpc_budget: list[int] | None = None

    @property
    def changes_plan(self) -> bool:
        """Whether anything is given that a re-plan of an installed model must weigh."""
        return (any(v is not None for v in (self.vram_budget, self.ctx, self.prefill_weight, self.threads,
                                            self.ubatch, self.prompt_tokens, self.calibration, self.rpc,
                                            self.rpc_budget))
                or self.spec != KeepInstalled())

    def over(self, asked: PlanRequest, ctx: int, budget_kept: bool = True) -> PlanRequest:
        """The request these choices make of `asked` (an installed model's, or a new PlanRequest) at
        the context resolved for them; budget_kept False: a budget not given is each GPU's free VRAM
        (None), not the one asked before."""
        spec = self.spec.resolve(asked.spec.to_json() if asked.spec else None) \
            if isinstance(self.spec, KeepInstalled) else self.spec
        request = asked.given(prefill_weight=self.prefill_weight, threads=self.threads, ubatch=self.ubatch,
                              prompt_tokens=self.prompt_tokens, calibration=self.calibration,
                              vram_budget=self.vram_budget, rpc=self.rpc, rpc_budget=self.rpc_budget)
        if self.rpc == ():
            request = replace(request, rpc_budget=None)
        if self.calibration is not None:  # a calibration named now: its figures, not the fitted ones a check chose
            request = replace(request, costs=COSTS_MACHINE)
        budget = request.vram_budget if budget_kept or self.vram_budget is not None else None
        return replace(request, ctx=ctx, spec=spec, vram_budget=budget)
