"""`p`: type a VRAM budget, see the plan `moeplug plan` makes for it, restart the model with it."""

from __future__ import annotations

import shlex
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static
from textual.worker import get_current_worker

from moeplug.core.errors import MoeplugError
from moeplug.planner.record import describe_slots
from moeplug.core.sizes import parse_size
from moeplug.tui import actions
from moeplug.tui.format import percent


def plan_text(p: dict[str, Any]) -> str:
    budget = f"{p['vram_budget_bytes'] / (1 << 30):.2f} GiB" if p["vram_budget_bytes"] else "no GPU"
    lines = [f"budget {budget}: {describe_slots(p['slots_per_layer'], p['n_expert'])}",
             f"fit {p['fit_fraction']:.0%}, predicted hit rate {percent(p['predicted_hit_rate'])}",
             f"args {shlex.join(p['server_args'])}"]
    lines += [f"⚠ {w}" for w in p["warnings"]]
    return "\n".join(lines)


class ReplanScreen(ModalScreen[int | None]):
    """Dismissed with the budget in bytes to restart with, or None (cancelled)."""

    BINDINGS = [("escape", "dismiss(None)", "cancel"), ("ctrl+r", "restart", "restart with this plan")]

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = name
        self.budget: int | None = None
        self.planned = False

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="replan"):
            yield Label(f"re-plan {self.model}: VRAM budget (e.g. 12GiB), enter to plan", classes="title")
            yield Input(placeholder="12GiB", id="budget")
            yield Static("", id="plan")
            yield Label("ctrl+r restarts with the plan shown, escape cancels", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        try:
            self.budget = parse_size(event.value)
        except MoeplugError as exc:
            self.query_one("#plan", Static).update(f"error: {exc}")
            return
        self.planned = False
        self.query_one("#plan", Static).update("planning...")
        self.make_plan(self.budget)

    @work(thread=True, exclusive=True, group="plan")
    def make_plan(self, budget: int) -> None:
        try:
            text, ok = plan_text(actions.plan(self.model, budget)), True
        except Exception as exc:  # noqa: BLE001 - shown, never a crash
            text, ok = f"error: {exc}", False
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._planned, text, ok)

    def _planned(self, text: str, ok: bool) -> None:
        self.planned = ok
        self.query_one("#plan", Static).update(text)

    def action_restart(self) -> None:
        if self.planned:
            self.dismiss(self.budget)
