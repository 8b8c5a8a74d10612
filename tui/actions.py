"""The dashboard's actions: each one the library call its CLI command makes.

start  = `moeplug serve NAME`              (moeplug.operations.actions.serve; counters and recording on by default)
restart = `moeplug stop NAME && moeplug serve NAME --port PORT`: a model served without the hit counters
stop   = `moeplug stop NAME`              (moeplug.operations.actions.stop)
plan   = `moeplug plan NAME --vram-budget B` for the installed model (moeplug.operations.install.plan_installed)
replan = `moeplug stop NAME && moeplug serve NAME --vram-budget B --metrics`
reprofile = the profile step of `moeplug install`, made again (moeplug.operations.install.remake_profile)

Every function here blocks (processes, HTTP, files): the screens call them from worker threads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any



def start(name: str) -> Any:
    from moeplug.operations.actions import serve
    from moeplug.planner.request import PlanChoices
    from moeplug.serving.launch import ServeOptions

    return serve(name, PlanChoices(), ServeOptions(metrics=True)).server  # the dashboard shows measured hit rates


def restart_counted(name: str) -> Any:
    """Serve a model that runs without the hit counters again with them, on the same port."""
    from moeplug.operations.actions import serve
    from moeplug.planner.request import PlanChoices
    from moeplug.serving.launch import ServeOptions, find_record

    record = find_record(name)
    stop(name)
    return serve(name, PlanChoices(), ServeOptions(port=record.port if record else None, metrics=True)).server


def stop(name: str) -> bool:
    from moeplug.operations.actions import stop as stop_model

    return name in stop_model(name).stopped


def plan(name: str, vram_budget: int | None) -> dict[str, Any]:
    from moeplug.serving.installed import read_installed
    from moeplug.operations.install import plan_installed

    from moeplug.planner.request import PlanChoices

    return plan_installed(read_installed(name), PlanChoices(vram_budget=vram_budget)).to_json()


def replan(name: str, vram_budget: int | None) -> Any:
    from moeplug.operations.actions import serve
    from moeplug.planner.request import PlanChoices
    from moeplug.serving.launch import ServeOptions

    stop(name)
    return serve(name, PlanChoices(vram_budget=vram_budget), ServeOptions(metrics=True)).server


def reprofile(name: str, progress: Callable[[int, int], None]) -> Path:
    """progress(prompts done, prompts in all), from the profiler's steps."""
    from moeplug.operations.install import remake_profile
    from moeplug.core.progress import Step

    def on_event(event: object) -> None:
        if isinstance(event, Step):
            progress(event.done, event.total)

    return remake_profile(name, progress=on_event)


def log_end(path: Path, lines: int = 300) -> list[str]:
    """The last lines of a server log for the log screen (the end of a file that may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 256 * 1024))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return [f"(no log at {path}: {exc.strerror})"]
