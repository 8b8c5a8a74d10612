"""`moeplug tui [--interval S]`: registered by moeplug.commands.main; Textual is imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moeplug.core.errors import EXIT_OK, MoeplugError
from moeplug.commands.options import SECONDS


def cmd_tui(args: argparse.Namespace) -> int:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise MoeplugError("the dashboard needs a terminal; for scripts use 'moeplug status --json'")
    from moeplug.tui.app import make_app

    make_app(interval=args.interval).run()
    return EXIT_OK


def add_tui_command(sub: Any) -> None:
    p = sub.add_parser("tui", help="dashboard: served models, expert slots, hit rates, GPUs; start/stop/re-plan",
                       description="A keyboard-driven dashboard of the models moeplug serves (q quits, ? shows "
                       "the keys). It refreshes on a timer and acts through the same code as the commands.")
    p.add_argument("--interval", type=SECONDS, default=2.0, help="seconds between refreshes (default 2)")
    p.set_defaults(func=cmd_tui)


register = add_tui_command  # moeplug.commands.main.COMMAND_MODULES
