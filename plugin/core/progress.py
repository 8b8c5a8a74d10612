"""Progress reports from library actions, for whoever called them.

Library code never prints: an action takes a `progress` callback and calls it with a `Note`
(a sentence for people) or a `Step` (done of total in a named task). The CLI renders them on
stderr (`moeplug.core.output.ProgressPrinter`); the dashboard or a test collects them; the default
drops them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Note:
    text: str


@dataclass(frozen=True)
class Step:
    task: str  # "build", "profiling", ...: one bar per task
    done: int
    total: int
    unit: str = "it"
    every: int = 10  # where no bar can be drawn (not a terminal): a line every this many percent (0: none)


Event = Note | Step
ProgressFn = Callable[[Event], None]


def silent(event: Event) -> None:
    """The default callback: reports go nowhere."""


def steps(progress: ProgressFn, task: str, unit: str = "it", every: int = 10) -> Callable[[int, int], None]:
    """A (done, total) callback that reports Steps of one task (make_model's progress form)."""
    return lambda done, total: progress(Step(task, done, total, unit, every))
