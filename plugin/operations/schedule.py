"""`moeplug schedule`: run `moeplug reprofile --all` periodically, from a systemd user timer or cron.

systemd (the default where `systemctl --user` answers, or with `user=True`): two unit files in the
user unit folder ($XDG_CONFIG_HOME/systemd/user): `moeplug-reprofile.service`, a oneshot that runs
the command (exit 10, nothing to do, counts as success), and `moeplug-reprofile.timer`
(`OnActiveSec=`/`OnUnitActiveSec=` the period: the first run one period after the timer starts).
They are enabled with `systemctl --user enable --now` when a user manager answers; otherwise
written, and the command that enables them is returned.

cron (`cron=True`): one line in the user's crontab, between marker comments, put there with the
`crontab` program (`crontab -l`, then `crontab -` with the new table). Without systemd and without
cron=True nothing is installed: the line is returned, to print. MOEPLUG_CRONTAB_FILE names a
file that stands for the crontab (tests, and systems without the program).

Every run of `moeplug reprofile` appends one line to the run log in the state dir
(`run_log_path()`, `reprofile.log`); `schedule status` shows its last lines.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.core.fsutil import write_text_atomic
from moeplug.core.paths import config_dir, state_dir

UNIT = "moeplug-reprofile"
CRON_BEGIN = "# >>> moeplug reprofile (moeplug schedule install --cron)"
CRON_END = "# <<< moeplug reprofile"
CRONTAB_FILE_ENV = "MOEPLUG_CRONTAB_FILE"
DEFAULT_EVERY = "6h"
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def run_log_path() -> Path:
    return state_dir() / "reprofile.log"


def append_run_log(line: str) -> None:
    """One line per run, appended in one write (runs never interleave inside a line)."""
    path = run_log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    text = f"{stamp} {' '.join(line.split())}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_run_log(lines: int = 5) -> list[str]:
    path = run_log_path()
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def parse_every(text: str) -> int:
    """'6h', '30m', '1d', '90s' -> seconds (at least 60: a re-profile takes a while)."""
    text = text.strip().lower()
    unit = text[-1:] if text[-1:] in _UNITS_S else ""
    number = text[: len(text) - len(unit)]
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"expected a period like 6h, 30m or 1d, got {text!r}")
    seconds = int(number) * _UNITS_S[unit or "s"]
    if seconds < 60:
        raise ValueError(f"{text}: at least 1m between runs")
    return seconds


def cron_spec(seconds: int) -> str:
    """The crontab time fields of a period: every N minutes (N dividing 60), N hours (N dividing
    24) or N days."""
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds % 60 == 0 and minutes < 60 and 60 % minutes == 0:
        return "* * * * *" if minutes == 1 else f"*/{minutes} * * * *"
    if seconds % 3600 == 0 and hours < 24 and 24 % hours == 0:
        return "0 * * * *" if hours == 1 else f"0 */{hours} * * *"
    if seconds % 86400 == 0:
        return "0 3 * * *" if days == 1 else f"0 3 */{days} * *"
    raise ValueError(f"cron cannot run every {seconds} s: give minutes dividing the hour, hours dividing the "
                     f"day, or days (e.g. 15m, 6h, 1d)")


def reprofile_command(args: list[str] | None = None) -> list[str]:
    """The command a scheduled run executes: this Python's moeplug, re-profiling every model."""
    return [sys.executable, "-m", "moeplug", "reprofile", "--all", *(args or [])]


def unit_dir() -> Path:
    """The systemd user unit folder ($XDG_CONFIG_HOME/systemd/user)."""
    return config_dir().parent / "systemd" / "user"


def unit_texts(every_s: int, command: list[str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")
           if k in os.environ}
    env_lines = "".join(f"Environment={shlex.quote(f'{k}={v}')}\n" for k, v in sorted(env.items()))
    service = ("[Unit]\n"
               "Description=moeplug: re-profile served MoE models and re-plan their expert slots\n\n"
               "[Service]\n"
               "Type=oneshot\n"
               f"{env_lines}"
               f"ExecStart={shlex.join(command)}\n"
               "# exit 10: nothing to re-plan (the routing has not drifted)\n"
               "SuccessExitStatus=10\n")
    timer = ("[Unit]\n"
             f"Description=moeplug: re-profile every {every_s} s\n\n"
             "[Timer]\n"
             f"OnActiveSec={every_s}s\n"
             f"OnUnitActiveSec={every_s}s\n\n"
             "[Install]\n"
             "WantedBy=timers.target\n")
    return {f"{UNIT}.service": service, f"{UNIT}.timer": timer}


def cron_line(every_s: int, command: list[str]) -> str:
    env = " ".join(shlex.quote(f"{k}={os.environ[k]}") for k in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")
                   if k in os.environ)
    return f"{cron_spec(every_s)} {env + ' ' if env else ''}{shlex.join(command)} >/dev/null 2>&1"


def systemd_user_available() -> bool:
    if not shutil.which("systemctl"):
        return False
    r = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True, timeout=10)
    return r.returncode == 0


# ---------------------------------------------------------------------------------------------
# crontab


def _read_crontab() -> str:
    path = os.environ.get(CRONTAB_FILE_ENV)
    if path:
        return Path(path).read_text() if Path(path).exists() else ""
    if not shutil.which("crontab"):
        raise MoeplugError(f"no crontab program here: install cron, use the systemd timer, or set {CRONTAB_FILE_ENV}")
    r = subprocess.run(["crontab", "-l"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        if "no crontab" in r.stderr.lower():
            return ""
        raise MoeplugError(f"crontab -l failed: {r.stderr.strip()}")
    return r.stdout


def _write_crontab(text: str) -> None:
    path = os.environ.get(CRONTAB_FILE_ENV)
    if path:
        write_text_atomic(Path(path), text)
        return
    r = subprocess.run(["crontab", "-"], input=text, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise MoeplugError(f"crontab - failed: {r.stderr.strip()}")


def _without_block(text: str) -> tuple[str, str | None]:
    """The crontab without moeplug's block, and the block's line (None: there is none)."""
    out, line, inside = [], None, False
    for raw in text.splitlines():
        if raw.strip() == CRON_BEGIN:
            inside = True
        elif raw.strip() == CRON_END and inside:
            inside = False
        elif inside:
            line = raw
        else:
            out.append(raw)
    return "\n".join(out) + ("\n" if out else ""), line


# ---------------------------------------------------------------------------------------------
# the actions


@dataclass
class Schedule:
    kind: str  # "systemd", "cron" or "none"
    every_s: int | None = None
    files: list[str] = field(default_factory=list)  # unit files written
    cron_line: str | None = None
    enabled: bool = False  # a timer enabled in a running user manager, or a line in the crontab
    next_step: str | None = None  # what the user still has to run, if anything
    log: str = ""
    last_runs: list[str] = field(default_factory=list)
    # installed models the scheduled `reprofile --all` will skip as they are served now: {"name", "why"}
    # (moeplug.operations.reprofile.not_reprofiled; the commands fill it in)
    not_reprofiled: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "every_s": self.every_s, "files": self.files, "cron_line": self.cron_line,
                "enabled": self.enabled, "next_step": self.next_step, "log": self.log, "last_runs": self.last_runs,
                "not_reprofiled": self.not_reprofiled}



def install_schedule(every: str = DEFAULT_EVERY, cron: bool = False, user: bool = False,
                     args: list[str] | None = None) -> Schedule:
    """Schedule `moeplug reprofile --all ARGS` every `every`: a crontab line (cron=True); else a
    systemd user service and timer (user=True, or where a systemd user manager answers), enabled
    when a user manager answers; else nothing is installed and the crontab line is returned with
    how to install it (--cron)."""
    every_s = parse_every(every)
    command = reprofile_command(args)
    log = str(run_log_path())
    if cron:
        line = cron_line(every_s, command)
        rest, _ = _without_block(_read_crontab())
        _write_crontab(f"{rest}{CRON_BEGIN}\n{line}\n{CRON_END}\n")
        return Schedule("cron", every_s, cron_line=line, enabled=True, log=log)
    manager = systemd_user_available()
    if not (user or manager):
        line = cron_line(every_s, command)
        return Schedule("none", every_s, cron_line=line, log=log,
                        next_step="no systemd user manager here: 'moeplug schedule install --cron' puts this line "
                                  "in your crontab")
    folder = unit_dir()
    files = []
    for name, text in unit_texts(every_s, command).items():
        write_text_atomic(folder / name, text)
        files.append(str(folder / name))
    enable = ["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", f"{UNIT}.timer"]
    if manager:
        for cmd in enable:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise MoeplugError(f"{shlex.join(cmd)} failed: {r.stderr.strip()} (the units are in {folder})")
        return Schedule("systemd", every_s, files, enabled=True, log=log)
    return Schedule("systemd", every_s, files, enabled=False, log=log,
                    next_step=" && ".join(shlex.join(c) for c in enable) + "  (no systemd user manager answers here)")


def schedule_status(lines: int = 5) -> Schedule:
    """What is scheduled (unit files, or moeplug's crontab line) and the last runs' log lines."""
    folder = unit_dir()
    files = [str(folder / n) for n in (f"{UNIT}.service", f"{UNIT}.timer") if (folder / n).exists()]
    line = None
    try:
        _, line = _without_block(_read_crontab())
    except MoeplugError:
        line = None
    kind = "systemd" if files else "cron" if line else "none"
    enabled = bool(line)
    if files and systemd_user_available():
        r = subprocess.run(["systemctl", "--user", "is-enabled", f"{UNIT}.timer"], capture_output=True, text=True,
                           timeout=10)
        enabled = r.stdout.strip() == "enabled"
    return Schedule(kind, None, files, cron_line=line, enabled=enabled, log=str(run_log_path()),
                    last_runs=read_run_log(lines) if kind != "none" else [])


def remove_schedule() -> Schedule:
    """Take the timer and its units, and moeplug's crontab block, away (whichever are there)."""
    folder = unit_dir()
    removed = [str(folder / n) for n in (f"{UNIT}.timer", f"{UNIT}.service") if (folder / n).exists()]
    if removed and systemd_user_available():
        subprocess.run(["systemctl", "--user", "disable", "--now", f"{UNIT}.timer"], capture_output=True, timeout=30)
    for f in removed:
        Path(f).unlink()
    line = None
    try:
        rest, line = _without_block(_read_crontab())
        if line is not None:
            _write_crontab(rest)
    except MoeplugError:
        pass
    kind = "systemd" if removed else "cron" if line else "none"
    return Schedule(kind, None, removed, cron_line=line, enabled=False, log=str(run_log_path()))
