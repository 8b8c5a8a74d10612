"""Run a program with its output going to a log file, and quote the log's last lines in errors.

The native build, the router profiler and llama-server all write logs that a failure points
to; this is the one place that runs such a program and the one way a log's tail is quoted.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from moeplug.core.errors import MoeplugError


def log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a log, joined with ' | ' to fit an error's one line."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_logged(cmd: list[str], log: Path, what: str, *, on_line: Callable[[str], None] | None = None,
               append: bool = False, error: type[MoeplugError] = MoeplugError, tail: int = 3) -> None:
    """Run cmd (no shell), stdout and stderr into log; each line also to on_line (progress parsing).
    A non-zero exit raises `error` naming what failed, the exit code, the log's tail and the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if append else "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if on_line:
                on_line(line)
        rc = proc.wait()
    if rc != 0:
        raise error(f"{what} failed (exit {rc}): {log_tail(log, tail)} (log: {log})")
