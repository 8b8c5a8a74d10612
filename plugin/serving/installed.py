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
from moeplug.core.paths import data_dir
from moeplug.model.refs import ModelRef
from moeplug.planner.record import Plan
from moeplug.planner.request import PlanRequest
from moeplug.planner.speculation import Speculation

SLOTS_ON_CPU_ENV = {"LLAMA_MOE_CACHE_DEVICE": "CPU"}


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
        doc = asdict(self) | {"plan": self.plan.to_json(), "request": self.request.to_json() if self.request else None}
        return doc if self.request else {k: v for k, v in doc.items() if k != "request"}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> InstalledModel:
        request = PlanRequest.from_json(doc["request"]) if doc.get("request") else None
        return cls(**(doc | {"plan": Plan.from_json(doc["plan"]), "request": request}))


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
