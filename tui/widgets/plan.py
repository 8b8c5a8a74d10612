"""The selected model's plan (server args, notes) and profile (sources, age, tokens, coverage)."""

from __future__ import annotations

import shlex

from textual.widgets import Static

from moeplug.monitor import ServerSnapshot
from moeplug.tui.format import duration


def plan_lines(s: ServerSnapshot | None, now: float) -> list[str]:
    if s is None:
        return []
    lines = []
    p = s.profile
    if p:
        lines.append(f"profile {duration(now - p.made_at)} old: {'+'.join(p.sources)}")
        lines.append(f"tokens {p.tokens_prefill} pp + {p.tokens_decode} tg")
        curve = " ".join(f"{n}:{'-' if v is None else f'{v:.0%}'}" for n, v in list(p.coverage.items())[-4:])
        lines.append(f"hit@slots {curve}")
    else:
        lines.append("no profile")
    if s.plan:
        lines.append(f"args {shlex.join(s.plan['server_args'])}")
        lines += [f"note: {n}" for n in s.plan.get("notes") or []]
    return lines


class PlanPanel(Static):
    def show(self, s: ServerSnapshot | None, now: float) -> None:
        self.update("\n".join(plan_lines(s, now)))
