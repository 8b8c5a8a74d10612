"""The installed models: one record per model under the user data dir
(~/.local/share/moeplug/installed/NAME.json), with the plan it is served with; `serve`, `list`, `plan`,
the hooks, the dashboard and the re-profiler read them, install and re-plans write them (atomically).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
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

SLOTS_ON_CPU_ENV = {"LLAMA_MOE_CACHE_DEVICE": "CPU"}
PLACEMENTS = ("moeplug", "stock")  # what a model is served with: its plan, or stock --fit's placement


@dataclass
class Verdict:
    """What the check measured and which placement it serves."""

    placement: str  # PLACEMENTS
    decode: float | None  # moeplug's decode t/s over stock's, the median over the prompts
    prefill: float | None
    decode_lowest: float | None
    prompts: int
    budget_bytes: int | list[int] | None
    checked_at: float
    bar: float = 0.95  # the share of stock's decode below which stock's placement is served

    def line(self) -> str:
        """'here: decode 1.31x, prefill 1.12x of stock --fit at 12.00 GiB, 3 prompts'"""
        budget = self.budget_bytes
        at = ("no GPU" if budget is None else human_bytes(sum(budget)) if isinstance(budget, list)
              else human_bytes(budget))
        return (f"here: decode {_ratio(self.decode)}, prefill {_ratio(self.prefill)} of stock --fit at {at}, "
                f"{self.prompts} prompts")

    def why(self) -> str:
        """Why this placement is served, in one line."""
        if self.placement == "stock":
            return (f"serving stock's placement: the slots ran {_ratio(self.decode)} here, below {_ratio(self.bar)}; "
                    f"'moeplug bench' to look closer")
        return "serving moeplug's plan: " + self.line()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> Verdict | None:
        return cls(**doc) if doc else None


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

    def server_env(self) -> dict[str, str]:
        """The environment its llama-server runs with beside the plan's flags."""
        return (dict(SLOTS_ON_CPU_ENV) if self.slots_on_cpu else {}) | self.plan.server_env()

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
