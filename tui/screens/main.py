"""The dashboard: served models on top, the selected model's slots, GPUs and plan below.

A timer starts a poll in a worker thread (moeplug.serving.monitor, through the app's source); the
result comes back to the UI thread with call_from_thread. Actions run in worker threads too;
the activity line and its progress bar say what runs, and how it ended.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header
from textual.worker import Worker, WorkerState, get_current_worker

from moeplug.serving.monitor import ServerMetrics, Snapshot
from moeplug.tui import actions
from moeplug.tui.screens.confirm import ConfirmScreen
from moeplug.tui.screens.help import HelpScreen
from moeplug.tui.screens.log import LogScreen
from moeplug.tui.screens.replan import ReplanScreen
from moeplug.tui.widgets.activity import ActivityBar
from moeplug.tui.widgets.gpus import GpuPanel
from moeplug.tui.widgets.plan import PlanPanel
from moeplug.tui.widgets.servers import ServersTable, server_rows
from moeplug.tui.widgets.slots import SlotsPanel


class MainScreen(Screen[None]):
    BINDINGS = [("s", "start", "start"), ("x", "stop", "stop"), ("p", "replan", "re-plan"),
                ("r", "reprofile", "re-profile"), ("l", "log", "log"), ("question_mark", "help", "keys"),
                ("q", "app.quit", "quit")]

    def __init__(self, source: Callable[[], Snapshot], interval: float) -> None:
        super().__init__()
        self.source, self.interval = source, interval
        self.snap: Snapshot | None = None
        self.refreshes = 0  # snapshots shown so far (tests wait on it)
        self._previous: dict[str, ServerMetrics] = {}
        self._recent: dict[str, ServerMetrics] = {}
        self._poll: Worker[None] | None = None
        self._busy = False

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield ServersTable(id="servers")
        with Horizontal(id="middle"):
            yield SlotsPanel(id="slots")
            with Vertical(id="side"):
                yield GpuPanel(id="gpus")
                yield PlanPanel(id="plan")
        yield ActivityBar(id="activity")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#slots").border_title = "expert slots"
        self.query_one("#gpus").border_title = "GPU"
        self.query_one("#plan").border_title = "plan and profile"
        self.query_one(ServersTable).focus()
        self.poll()
        if self.interval:
            self.set_interval(self.interval, self.poll)

    # -- polling ---------------------------------------------------------------------------------

    def poll(self) -> None:
        """A refresh, unless the last one still runs (a hung server costs its HTTP timeouts)."""
        if self._poll is None or self._poll.state not in (WorkerState.PENDING, WorkerState.RUNNING):
            self._poll = self._read_snapshot()

    @work(thread=True, exclusive=True, group="poll")
    def _read_snapshot(self) -> None:
        try:
            snap = self.source()
        except Exception as exc:  # noqa: BLE001 - a damaged state file, say: one line, the next refresh retries
            self.app.call_from_thread(self._say, f"refresh failed: {exc}")
            return
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self.show, snap)

    def show(self, snap: Snapshot) -> None:
        self.snap = snap
        for s in snap.servers:  # the last requests' throughput: the counters' growth between refreshes
            before = self._previous.get(s.name)
            if s.metrics and before and s.metrics.prompt_seconds >= before.prompt_seconds:  # not restarted
                self._recent[s.name] = s.metrics.since(before, self._recent.get(s.name) or s.metrics)
            else:
                self._recent.pop(s.name, None)
            if s.metrics:
                self._previous[s.name] = s.metrics
        served = len(snap.servers)
        self.sub_title = f"{served} served, {sum(s.healthy for s in snap.servers)} healthy"
        self.query_one(ServersTable).show(server_rows(snap, self._recent))
        self._show_selected()
        self.query_one(GpuPanel).show(snap)
        self.refreshes += 1

    def _show_selected(self) -> None:
        s = self.snap.server(self.selected_name or "") if self.snap else None
        self.query_one(SlotsPanel).show(s)
        self.query_one(PlanPanel).show(s, self.snap.taken_at if self.snap else 0.0)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "servers":
            self._show_selected()

    @property
    def selected_name(self) -> str | None:
        return self.query_one(ServersTable).selected_name

    # -- actions ---------------------------------------------------------------------------------

    def _say(self, text: str, done: int | None = None, total: int | None = None) -> None:
        bar = self.query_one(ActivityBar)
        bar.say(text)
        bar.progress(done, total)

    def _ready(self, what: str) -> str | None:
        """The selected model's name, or None (and why) when there is none or an action runs."""
        if self._busy:
            self._say("busy: wait for the running action to end")
            return None
        if not self.selected_name:
            self._say(f"nothing to {what}: no model installed ('moeplug install demo' makes one)")
        return self.selected_name

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_stop(self) -> None:
        name = self._ready("stop")
        if name:
            self.app.push_screen(ConfirmScreen(f"stop {name}?"),
                                 lambda yes: self._run(f"stopping {name}", lambda: self._stopped(name)) if yes else None)

    def _stopped(self, name: str) -> str:
        return f"{name} stopped" if actions.stop(name) else f"{name} was not running"

    def action_start(self) -> None:
        name = self._ready("start")
        s = self.snap.server(name or "") if self.snap else None
        if name and s is not None and s.alive:
            if "--metrics" in s.record.args:
                self._say(f"{name} is already served at {s.record.url} (x stops it)")
                return
            self.app.push_screen(ConfirmScreen(f"{name} runs without the hit counters: restart it with them?"),
                                 lambda yes: self._run(
                                     f"restarting {name} with the hit counters",
                                     lambda: f"{name} serving at {actions.restart_counted(name).url} with the "
                                             f"hit counters") if yes else None)
            return
        if name:
            self.app.push_screen(ConfirmScreen(f"start {name}?"), lambda yes: self._run(
                f"starting {name} (loads, checks the cache, probes the context)",
                lambda: f"{name} serving at {actions.start(name).url}") if yes else None)

    def action_replan(self) -> None:
        name = self._ready("re-plan")
        if name:
            def restart(budget: int | None) -> None:
                if budget is not None:
                    self._run(f"restarting {name} with the new plan",
                              lambda: f"{name} serving at {actions.replan(name, budget).url} with the new plan")
            self.app.push_screen(ReplanScreen(name), restart)

    def action_reprofile(self) -> None:
        name = self._ready("re-profile")
        if name:
            self.app.push_screen(ConfirmScreen(f"re-profile {name} with the bundled prompts?"), lambda yes: self._run(
                f"profiling {name}", lambda: self._reprofiled(name), progress=True) if yes else None)

    def _reprofiled(self, name: str) -> str:
        def progress(done: int, total: int) -> None:
            self.app.call_from_thread(self._say, f"profiling {name}: prompt {done}/{total}", done, total)

        path = actions.reprofile(name, progress)
        return f"profile of {name} made again ({path.name}); re-plan (p) to use it"

    def action_log(self) -> None:
        s = self.snap.server(self.selected_name or "") if self.snap else None
        if s is None:
            self._say("no log: the model is not served")
            return
        self.app.push_screen(LogScreen(Path(s.record.log), self.interval))

    def _run(self, doing: str, job: Callable[[], str], progress: bool = False) -> None:
        self._busy = True
        self._say(f"{doing}...", 0 if progress else None, None)
        self._action(job)

    @work(thread=True, exclusive=True, group="action")
    def _action(self, job: Callable[[], Any]) -> None:
        try:
            text = job()
        except Exception as exc:  # noqa: BLE001 - one line on the activity bar, never a crash
            text = f"error: {exc}"
        self.app.call_from_thread(self._finished, text)

    def _finished(self, text: str) -> None:
        self._busy = False
        self._say(text)
        self.poll()
