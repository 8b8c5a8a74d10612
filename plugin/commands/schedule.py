"""`moeplug schedule install | status | remove`: `moeplug reprofile --all` from a systemd user timer or
cron (moeplug.operations.schedule)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from moeplug.core.errors import EXIT_USAGE, MoeplugError
from moeplug.commands.options import add_json
from moeplug.core.output import Output


def schedule_text(s: Any) -> str:
    lines = []
    if s.files:
        lines += [f"unit file: {f}" for f in s.files]
    if s.cron_line:
        lines.append(f"crontab line: {s.cron_line}")
    if s.kind == "none" and not s.cron_line:
        lines.append("nothing scheduled ('moeplug schedule install' sets it up)")
    elif s.kind != "none":
        lines.append(f"{s.kind}: {'enabled' if s.enabled else 'not enabled'}")
    if s.next_step:
        lines.append(f"next: {s.next_step}")
    lines += [f"not re-profiled: {m['name']}: {m['why']}" for m in s.not_reprofiled]
    lines.append(f"run log: {s.log}")
    lines += [f"  {line}" for line in s.last_runs]
    return "\n".join(lines)


def cmd_install(args: argparse.Namespace) -> int:
    from moeplug.operations.schedule import install_schedule

    if args.cron and args.user:
        raise MoeplugError("schedule install: --user (a systemd timer) or --cron, not both", EXIT_USAGE)
    from moeplug.operations.reprofile import not_reprofiled

    try:
        done = install_schedule(args.every, cron=args.cron, user=args.user, args=shlex.split(args.args or ""))
    except ValueError as exc:
        raise MoeplugError(f"--every: {exc}", EXIT_USAGE) from None
    done.not_reprofiled = not_reprofiled()
    return Output.for_args(args).result(done, schedule_text)


def cmd_status(args: argparse.Namespace) -> int:
    from moeplug.operations.reprofile import not_reprofiled
    from moeplug.operations.schedule import schedule_status

    status = schedule_status()
    if status.kind != "none":
        status.not_reprofiled = not_reprofiled()
    return Output.for_args(args).result(status, schedule_text)


def cmd_remove(args: argparse.Namespace) -> int:
    from moeplug.operations.schedule import remove_schedule

    return Output.for_args(args).result(remove_schedule(), lambda s: (
        "removed: " + ", ".join(s.files + ([f"crontab line {s.cron_line}"] if s.cron_line else []))
        if s.kind != "none" else "nothing was scheduled"))


def register(sub: Any) -> None:
    """schedule install | status | remove."""
    from moeplug.operations.schedule import DEFAULT_EVERY

    group = sub.add_parser("schedule", help="run 'moeplug reprofile --all' periodically (systemd user timer or cron)")
    s = group.add_subparsers(dest="schedule_command", metavar="{install,status,remove}", required=True,
                             parser_class=type(group))
    p = s.add_parser("install", help="a systemd user service + timer, or with --cron a crontab line",
                     description="Schedule 'moeplug reprofile --all' every --every: a systemd user service and timer "
                     "(--user, the default where a systemd user manager answers), or a line in your crontab (--cron). "
                     "Without systemd and without --cron, prints the crontab line. Each run logs one line to the "
                     "state dir's reprofile.log.")
    p.add_argument("--every", default=DEFAULT_EVERY, help=f"the period: 30m, 6h, 1d (default {DEFAULT_EVERY})")
    p.add_argument("--user", action="store_true", help="write the systemd user units even without a user manager")
    p.add_argument("--cron", action="store_true", help="install the crontab line instead")
    p.add_argument("--args", default="", help="more options for the scheduled 'moeplug reprofile --all', "
                   "quoted as one word, e.g. --args '--apply never'")
    add_json(p)
    p.set_defaults(func=cmd_install)

    p = s.add_parser("status", help="what is scheduled, and the last runs")
    add_json(p)
    p.set_defaults(func=cmd_status)

    p = s.add_parser("remove", help="remove the timer and its units, or the crontab line")
    add_json(p)
    p.set_defaults(func=cmd_remove)
