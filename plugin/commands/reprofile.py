"""`moeplug reprofile NAME|--all`: re-profile, report drift, re-plan, restart (moeplug.operations.reprofile)."""

from __future__ import annotations

import argparse
from typing import Any

from moeplug.core.errors import EXIT_NOTHING_TO_DO, EXIT_USAGE, MoeplugError
from moeplug.commands.options import GAIN, HALF_LIFE, IDLE_SECONDS, SECONDS, add_json
from moeplug.core.output import Output, table


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def model_text(r: Any) -> str:
    if hasattr(r, "skipped"):
        return f"{r.name}: skipped: {r.skipped}"
    if hasattr(r, "error"):
        return f"{r.name}: error: {r.error}"
    if not hasattr(r, "gain"):  # rolled back
        lines = [f"{r.name}: restored the previous profile {r.profile} (the replaced one kept as {r.previous})",
                 f"  slots per layer {r.slots_before} -> {r.slots_after}" if r.plan_changed else "  plan unchanged"]
        return "\n".join(lines + [f"  server: {_applied(r)}"])
    if r.source == "log":  # served without --record: the workload alone
        lines = [f"{r.name}: the server's log, its routing not counted"] + [f"  note: {n}" for n in r.notes]
        lines += _workload_lines(r)
        return "\n".join(lines + [_slots_line(r), f"  server: {_applied(r)}"])
    what = "the server's live counts" if r.source == "live" else "the prompt sets"
    lines = [f"{r.name}: {r.tokens['prefill']} prompt + {r.tokens['decode']} generated tokens from {what}; stored "
             f"counts weighted {r.old_weight:.3f} (half-life {r.half_life} tokens)"]
    lines += [f"  note: {n}" for n in r.notes]
    rows = [[x.block, x.slots, _pct(x.predicted), _pct(x.measured), f"{100 * x.drift:+.1f}" if x.drift is not None
             else "-"] for x in r.layers]
    lines.append(table(["block", "slots", "predicted", "on new counts", "drift (points)"], rows, "rrrrr"))
    lines.append(f"  current slots on the new counts: {_pct(r.measured)} (the plan predicted {_pct(r.plan_predicted)}); "
                 f"a new plan predicts {_pct(r.new_predicted)}: gain {100 * r.gain:+.1f} points")
    lines += _workload_lines(r)
    if not r.replanned:
        lines.append(f"  nothing to do: the gain is below --min-gain ({100 * r.min_gain:.1f} points)"
                     + (" and the traffic's workload leaves the plan as it is" if r.workload else "")
                     + "; nothing written")
        return "\n".join(lines)
    if r.written:
        lines.append(f"  profile replaced: {r.profile}" + (f" (previous kept: {r.previous}; 'moeplug reprofile "
                                                           f"{r.name} --rollback' restores it)" if r.previous else ""))
    lines.append(_slots_line(r))
    lines.append(f"  server: {_applied(r)}")
    return "\n".join(lines)


def _slots_line(r: Any) -> str:
    if r.slots_before != r.slots_after:
        return f"  slots per layer {r.slots_before} -> {r.slots_after}"
    return f"  slots per layer {r.slots_after} (re-planned: {'changed' if r.plan_changed else 'unchanged'})"


def _workload_lines(r: Any) -> list[str]:
    """What the served traffic looked like and what the plan learned from it."""
    if r.traffic is None:
        return []
    lines = [f"  traffic served: {r.traffic.summary()}"]
    if r.workload:
        length = r.workload["prompt_tokens"]
        lines.append(f"  workload {'planned for' if r.workload_stored else 'learned'}: --prefill-weight "
                     f"{r.workload['prefill_weight']:g}, --prompt-tokens {length if length else '0 (the profile prompts)'}")
    return lines


def _applied(r: Any) -> str:
    return {"restarted": f"restarted with the new plan at {r.server.url if r.server else '?'}",
            "not served": "not served (the next 'moeplug serve' uses the new plan)",
            "never": "not restarted (--apply never: the next 'moeplug serve' uses the new plan)",
            "busy": "not restarted: it was never idle long enough (the next 'moeplug serve' uses the new plan)",
            "unchanged": "not restarted: it runs the new plan's flags already",
            }.get(r.applied, r.applied)


def cmd_reprofile(args: argparse.Namespace) -> int:
    from moeplug.operations.reprofile import Options, add_prompt_files, reprofile

    if bool(args.model) == bool(args.all):
        raise MoeplugError("reprofile: name one installed model, or pass --all", EXIT_USAGE)
    if args.prompt_file and not args.model:
        raise MoeplugError("reprofile: --prompt-file goes with one model's NAME", EXIT_USAGE)
    out = Output.for_args(args)
    if args.prompt_file:
        add_prompt_files(args.model, args.prompt_file, out.progress)
    opts = Options(half_life=args.half_life, min_gain=args.min_gain, apply=args.apply, idle_s=args.idle,
                   wait_s=args.wait, workload=args.workload)
    run = reprofile([args.model] if args.model else None, opts, roll_back=args.rollback, progress=out.progress)
    return out.result(run, lambda r: "\n".join(model_text(x) for x in r.results) or "no installed model")


EPILOG = f"""exit codes:
  0    done: a model's profile was replaced and re-planned (or rolled back), or its plan
       re-planned for the workload its traffic showed
  {EXIT_NOTHING_TO_DO}   nothing to do: no model's new plan gains --min-gain, no traffic changes
       a plan; nothing was written
  1    error (one model failing fails the run; the others still ran); with --all, a
       model served without recording (--no-record) is skipped, with why, not an error
  2    usage error

The stored counts are aged by the new tokens T (prompt + generated): multiplied by
0.5 ** (T / HALF_LIFE), the new counts added at weight 1. Every run appends one line to
the run log in the state dir (moeplug schedule status shows it)."""


def register(sub: Any) -> None:
    """reprofile."""
    from moeplug.operations.reprofile import (APPLY_MODES, DEFAULT_HALF_LIFE, DEFAULT_IDLE_S, DEFAULT_MIN_GAIN, DEFAULT_WAIT_S,
                                   WORKLOAD_MODES)
    from moeplug.serving.traffic import MIN_REQUESTS

    p = sub.add_parser(
        "reprofile", help="learn the routing of real traffic, report drift, re-plan and restart when worth it",
        description="Re-profile an installed model: a served model's live routing counts (served recording, the "
        "default; not with --no-record), "
        "or the bundled prompts and the model's prompt files when it is not served; merge them into the stored "
        "profile with a decay, report the drift per layer and the new plan's gain, and when the gain reaches "
        "--min-gain replace the profile (keeping the previous one), re-plan, update the hooks and restart the "
        "server per --apply (a request in flight is never cut). A served model's log also gives its workload "
        "(--workload): prompt lengths and prompt tokens per generated token, which a re-plan follows; served "
        "with --no-record, that alone (--all skips such a model when its log has nothing to learn either).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="NAME", help="an installed model (see 'moeplug list')")
    p.add_argument("--all", action="store_true", help="every installed model")
    p.add_argument("--half-life", type=HALF_LIFE, default=DEFAULT_HALF_LIFE,
                   help=f"tokens after which a recorded selection counts half (default {DEFAULT_HALF_LIFE})")
    p.add_argument("--min-gain", type=GAIN, default=DEFAULT_MIN_GAIN,
                   help=f"the least gain in predicted hit rate (a share, 0-1; default {DEFAULT_MIN_GAIN}) worth a "
                        f"re-plan; 0: whenever the new plan predicts no less than the current slots serve")
    p.add_argument("--apply", choices=APPLY_MODES, default="idle",
                   help="restart a served model with the new plan: once idle for --idle seconds (default), as soon "
                        "as no request is in flight (now), or not (never)")
    p.add_argument("--idle", type=IDLE_SECONDS, default=DEFAULT_IDLE_S,
                   help=f"seconds without a request before an --apply idle restart (default {DEFAULT_IDLE_S:g}; "
                        f"0: as soon as none is in flight)")
    p.add_argument("--wait", type=SECONDS, default=DEFAULT_WAIT_S,
                   help=f"the longest to wait for that moment, in seconds (default {DEFAULT_WAIT_S:g}); then the "
                        f"restart is left to the next serve")
    p.add_argument("--workload", choices=WORKLOAD_MODES, default="auto",
                   help=f"plan a served model for the prompts its log shows (from {MIN_REQUESTS} requests on): "
                        f"prompt tokens per generated token (--prefill-weight) and the prompt length that carries "
                        f"half the prompt tokens (--prompt-tokens), which choose the prompt batch; auto (default): "
                        f"unless set by hand; learn: also over values set by hand; keep: never")
    p.add_argument("--rollback", action="store_true",
                   help="restore the profile the last re-profile replaced, re-plan and apply")
    p.add_argument("--prompt-file", action="append", metavar="FILE",
                   help="add a prompt file (.txt, prompts separated by '---' lines) to the model's prompt_files, "
                        "run besides the bundled prompts when it is not served (kept for later runs; repeatable)")
    add_json(p)
    p.set_defaults(func=cmd_reprofile)
