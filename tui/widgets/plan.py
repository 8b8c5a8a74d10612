"""The selected model's plan (server args, notes) and profile (sources, age, tokens, coverage)."""

from __future__ import annotations

import shlex

from textual.widgets import Static

from moeplug.serving.monitor import ServerSnapshot
from moeplug.tui.format import duration


def plan_lines(s: ServerSnapshot | None, now: float) -> list[str]:
    if s is None:
        return []
    lines = []
    p = s.profile
    if p:
        lines.append(f"profile {'+'.join(p.sources)}")
        lines.append(f"  {duration(now - p.made_at)} old, {p.tokens_prefill}+{p.tokens_decode} tokens")
        curve = " ".join(f"{n}:{'-' if v is None else f'{v:.0%}'}" for n, v in list(p.coverage.items())[-3:])
        lines.append(f"  hit {curve}")  # static slots of N per layer, `moeplug profile analyze`
    else:
        lines.append("no profile")
    t = s.traffic
    if t and t.requests:
        lines.append(f"served {t.requests} requests: prompts {t.prompt_median}+ tokens carry half, "
                     f"{t.prefill_weight:.3g} prompt tokens per generated")
    if s.plan:
        p = s.plan
        lines.append(f"planned for {p.prefill_weight:g} per generated, "
                     + (f"prompts of {p.prompt_tokens}" if p.prompt_tokens else "the profile's prompts")
                     + (", learned" if p.workload else "") + f", -ub {p.ubatch}")
        if s.placement_why or s.placement == "stock":
            lines.append(s.placement_why or "served with stock's placement")
        lines.append(f"args {shlex.join(p.server_args)}")
        lines += [f"note: {n}" for n in p.notes or []]
    return lines


class PlanPanel(Static):
    def show(self, s: ServerSnapshot | None, now: float) -> None:
        self.update("\n".join(plan_lines(s, now)))
