"""`l`: a served model's log at its tail, following it while open."""

from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.screen import ModalScreen
from textual.widgets import Label, Log
from textual.worker import get_current_worker

from moeplug.tui import actions


class LogScreen(ModalScreen[None]):
    BINDINGS = [("escape,l", "dismiss", "close")]

    def __init__(self, path: Path, interval: float) -> None:
        super().__init__()
        self.path, self.interval = path, interval
        self._shown: list[str] = []

    def compose(self) -> ComposeResult:
        yield Label(f"{self.path}  (escape closes)", classes="title")
        yield Log(id="log", max_lines=2000)

    def on_mount(self) -> None:
        self.read_tail()
        if self.interval:
            self.set_interval(self.interval, self.read_tail)

    @work(thread=True, exclusive=True, group="log")
    def read_tail(self) -> None:
        lines = actions.log_end(self.path)
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self._show, lines)

    def _show(self, lines: list[str]) -> None:
        if lines == self._shown:
            return
        log = self.query_one(Log)
        log.clear()
        log.write_lines(lines)
        self._shown = lines
