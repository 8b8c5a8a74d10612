"""What the dashboard is doing: a line of text and, for long actions, a progress bar."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar


class ActivityBar(Horizontal):
    def compose(self) -> ComposeResult:
        yield Label("", id="activity-text")
        yield ProgressBar(total=None, show_eta=False, id="activity-progress")

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False

    def say(self, text: str) -> None:
        self.query_one("#activity-text", Label).update(text)

    def progress(self, done: int | None, total: int | None) -> None:
        """done None: hide the bar; total None: an indeterminate bar."""
        bar = self.query_one(ProgressBar)
        bar.display = done is not None
        if done is not None:
            bar.update(total=total, progress=done)
