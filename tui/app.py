"""The dashboard's App: it only builds itself and pushes the main screen."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from textual.app import App

from moeplug.serving.monitor import Snapshot, snapshot
from moeplug.tui.screens.main import MainScreen


class DashboardApp(App[None]):
    CSS_PATH = "dashboard.tcss"
    TITLE = "moeplug"
    BINDINGS = [("q", "quit", "quit")]

    def __init__(self, source: Callable[[], Snapshot], interval: float) -> None:
        super().__init__()
        self.source, self.interval = source, interval

    def on_mount(self) -> None:
        self.push_screen(MainScreen(self.source, self.interval))


def make_app(interval: float = 2.0, snapshots: Sequence[Snapshot] | None = None) -> DashboardApp:
    """The dashboard on live snapshots (moeplug.serving.monitor), or on recorded ones: each refresh takes
    the next, then the last again (screenshots and layout tests; interval 0: no timer)."""
    if snapshots is None:
        return DashboardApp(partial(snapshot, with_profiles=True), interval)
    recorded = list(snapshots)

    def replay() -> Snapshot:
        return recorded.pop(0) if len(recorded) > 1 else recorded[0]

    return DashboardApp(replay, interval)
