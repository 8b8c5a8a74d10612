"""The installed models: one record per model under the user data dir
(~/.local/share/moeplug/installed/NAME.json), with the plan it is served with; `serve`, `list`, `plan`,
the hooks, the dashboard and the re-profiler read them, install and re-plans write them (atomically).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.core.fsutil import write_text_atomic
from moeplug.core.output import human_bytes
from moeplug.core.paths import data_dir
from moeplug.model.refs import ModelRef
from moeplug.planner.record import Plan
from moeplug.planner.request import PlanRequest
from moeplug.planner.speculation import Speculation

PLACEMENTS = ("moeplug", "stock")  # what a model is served with: its plan, or stock --fit's placement


# the placements the install's check runs (operations.check): the plan made with this machine's figures, the
# plan made with the figures fitted on the GPU machine (where it differs), stock --fit's placement
CANDIDATES = ("plan", "fitted", "stock")


@dataclass
class Candidate:
    """One placement the check ran, and what it measured: t/s are each the median over the prompts of a
    prompt's median over its rounds; ratios are to stock's placement, per prompt, then the median (and
    the lowest) over the prompts."""

    name: str  # CANDIDATES
    costs: str  # the figures its plan was made with (CostModel.describe), "" for stock's placement
    args: list[str]  # its llama-server's flags
    rounds: int  # rounds it ran (the close ones run more)
    decode_tps: float | None = None
    prefill_tps: float | None = None
    decode: float | None = None  # its decode over stock's (1.0 for stock's own)
    decode_lowest: float | None = None
    decode_interval: list[float] | None = None  # the 95% interval of `decode` over the rounds
    prefill: float | None = None
    summary: str = ""  # its plan in a few words: "17 whole layers, 3833 slots, dynamic"
    # what the check judges by: generated tokens a second with prefill_weight prompt tokens prefilled for each,
    # over stock's (operations.check); None in a verdict from before it was kept (judged by decode then)
    speed: float | None = None
    prefill_weight: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Verdict:
    """What the check measured and which placement it serves: every candidate's figures, the one served
    (`chosen`), and for the best plan its ratios to stock (decode, prefill, decode_lowest), which say
    how far the slots ran ahead of or behind stock's placement."""

    placement: str  # PLACEMENTS
    decode: float | None  # the best plan's decode t/s over stock's, the median over the prompts (Candidate.decode)
    prefill: float | None
    decode_lowest: float | None
    prompts: int
    budget_bytes: int | list[int] | None
    checked_at: float
    bar: float = 1.0  # the share of stock's speed (Candidate.speed) the best plan must reach to be served
    chosen: str = "plan"  # CANDIDATES: the one served
    candidates: list[Candidate] = field(default_factory=list)  # each one run, in CANDIDATES' order
    rounds: int = 1  # rounds every candidate ran
    seconds: float | None = None  # how long the check took
    speed: float | None = None  # the best plan's Candidate.speed, what the check judged by (None: decode was)

    def line(self) -> str:
        """'here: decode 1.31x, prefill 1.12x of stock --fit at 12.00 GiB, 4 prompts, 2 rounds'"""
        budget = self.budget_bytes
        at = ("no GPU" if budget is None else human_bytes(sum(budget)) if isinstance(budget, list)
              else human_bytes(budget))
        return (f"here: decode {_ratio(self.decode)}, prefill {_ratio(self.prefill)} of stock --fit at {at}, "
                f"{self.prompts} prompts, {self.rounds} round{'s' if self.rounds != 1 else ''}")

    def why(self) -> str:
        """Why this placement is served, in one line."""
        if self.placement == "stock":
            judged = self.decode if self.speed is None else self.speed
            return (f"serving stock's placement: the slots ran {_ratio(judged)} here, below {_ratio(self.bar)}; "
                    f"'moeplug bench' to look closer")
        which = " (made with the fitted figures, faster here than this machine's)" if self.chosen == "fitted" else ""
        return f"serving moeplug's plan{which}: " + self.line()

    def served(self, plan_args: list[str] | None = None) -> str:
        """The placement served, its measured decode ratio and when, for list and status:
        'its plan, decode 1.31x, checked 2026-12-07 14:02'; with the plan's server flags now
        (`plan_args`), a plan re-planned since the check says so."""
        what = "stock's placement" if self.placement == "stock" else \
            "its plan (fitted figures)" if self.chosen == "fitted" else "its plan"
        ratio = f", slots {_ratio(self.decode)}" if self.placement == "stock" else f", decode {_ratio(self.decode)}"
        since = ", re-planned since" if plan_args is not None and self.stale(plan_args) else ""
        return f"{what}{ratio if self.decode is not None else ''}, {self.when()}{since}"

    def stale(self, plan_args: list[str]) -> bool:
        """Whether the plan was made again since the check: its flags are none of the candidates' (a
        verdict from before candidates were kept cannot tell, and is taken as current)."""
        return bool(self.candidates) and all(c.args != plan_args for c in self.candidates if c.name != "stock")

    def when(self) -> str:
        """'checked 2026-12-07 14:02' (local time)."""
        return "checked " + time.strftime("%Y-%m-%d %H:%M", time.localtime(self.checked_at))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> Verdict | None:
        if not doc:
            return None
        return cls(**(doc | {"candidates": [Candidate(**c) for c in doc.get("candidates") or []]}))


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


@dataclass
class InstalledModel:
    name: str
    ref: str
    path: str
    profile: str | None
    build_id: str
    ctx: int
    plan: Plan
    slots_on_cpu: bool = False  # the demo's stand-in for a GPU: slots in RAM, same results, no speedup
    installed_at: float = field(default_factory=time.time)
    # prompt files (.txt, prompts separated by '---') that `moeplug reprofile` runs besides the
    # bundled sets when the model is not served: `moeplug reprofile NAME --prompt-file FILE`
    prompt_files: list[str] = field(default_factory=list)
    # what was asked for its plan (the budget as planned); None: a record from before requests were kept
    request: PlanRequest | None = None
    # the install's check of the plan against stock here (operations.check); None: not checked
    verdict: Verdict | None = None

    @property
    def placement(self) -> str:
        """What it is served with (PLACEMENTS): stock's placement where the check found the plan slower."""
        return self.verdict.placement if self.verdict else "moeplug"

    def asked(self) -> PlanRequest:
        """What was asked for this model's plan: the stored request, or, for a record from before
        requests were kept, the choices its plan recorded."""
        if self.request is not None:
            return self.request
        p = self.plan
        return PlanRequest(self.ctx, p.budget, spec=Speculation.from_json(p.speculation),
                           prefill_weight=p.prefill_weight, threads=p.threads_asked, ubatch=p.ubatch_asked,
                           prompt_tokens=p.prompt_tokens, workload=p.workload,
                           slots_in_ram=max(1, p.n_expert // 4) if self.slots_on_cpu else 0)

    def with_slots_in_ram(self, plan: Plan) -> Plan:
        """`plan` as this model serves it: where the demo's slots stand in RAM for a GPU (slots_on_cpu),
        with the flag that puts them there (--moe-cache-device CPU), as every road passes the plan's flags."""
        from moeplug.planner.server_flags import SLOTS_IN_RAM_ARGS

        if not self.slots_on_cpu or "--moe-cache-slots" not in plan.server_args or \
                SLOTS_IN_RAM_ARGS[0] in plan.server_args:
            return plan
        return replace(plan, server_args=[*plan.server_args, *SLOTS_IN_RAM_ARGS])

    def server_env(self) -> dict[str, str]:
        """The environment its llama-server runs with beside the plan's flags (the machine's device
        switches alone: the slots in RAM are the plan's flag --moe-cache-device CPU)."""
        return self.plan.server_env()

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self) | {"plan": self.plan.to_json(), "request": self.request.to_json() if self.request else None,
                              "verdict": self.verdict.to_json() if self.verdict else None}
        return {k: v for k, v in doc.items() if v is not None or k not in ("request", "verdict")}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> InstalledModel:
        request = PlanRequest.from_json(doc["request"]) if doc.get("request") else None
        return cls(**(doc | {"plan": Plan.from_json(doc["plan"]), "request": request,
                             "verdict": Verdict.from_json(doc.get("verdict"))}))


def installed_dir() -> Path:
    return data_dir() / "installed"


def model_name(ref: ModelRef) -> str:
    """A short, file-safe name: the recipe, 'demo', the repo and quant, or the file's stem."""
    if ref.recipe:
        raw = ref.recipe.name
    elif ref.kind == "demo":
        raw = "demo"
    elif ref.kind == "hf":
        raw = f"{str(ref.repo).split('/')[-1]}-{ref.filename or ref.quant}".removesuffix(".gguf")
    elif ref.kind == "ollama":
        raw = f"{ref.ollama_name}-{ref.ollama_tag}"
    else:
        raw = Path(str(ref.path)).stem
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-") or "model"


def read_installed(name: str) -> InstalledModel:
    path = installed_dir() / f"{name}.json"
    if not path.exists():
        known = ", ".join(m.name for m in list_installed()) or "none"
        raise MoeplugError(f"'{name}' is not installed (installed: {known}); run 'moeplug install {name}'")
    return InstalledModel.from_json(json.loads(path.read_text()))


def write_installed(record: InstalledModel) -> None:
    write_text_atomic(installed_dir() / f"{record.name}.json", json.dumps(record.to_json(), indent=2) + "\n")


def list_installed() -> list[InstalledModel]:
    folder = installed_dir()
    out = []
    for p in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            out.append(InstalledModel.from_json(json.loads(p.read_text())))
        except (ValueError, TypeError, KeyError):
            continue
    return out
