"""`?`: every key of the dashboard."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

KEYS = [
    ("up/down", "pick a model (the panels follow it)"),
    ("s", "start the model (moeplug serve NAME); served without counters: restart it with them"),
    ("x", "stop the model (moeplug stop NAME)"),
    ("p", "re-plan for a VRAM budget you type, then restart with it"),
    ("r", "re-profile the model (bundled prompts, progress below)"),
    ("l", "the server log, at its tail"),
    ("?", "these keys"),
    ("q", "quit (served models keep running)"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="help"):
            yield Label("keys", classes="title")
            yield Static("\n".join(f"{k:>8}  {what}" for k, what in KEYS))
            yield Label("escape closes", classes="hint")
