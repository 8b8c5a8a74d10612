"""`moeplug calibrate [MODEL]`: measure this machine's CPU and bus for the planner
(moeplug.operations.calibrate), or show the file already measured for this machine and build."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from moeplug.commands.options import THREADS, RpcHosts, add_json
from moeplug.core.output import Output, table


def _rate(v: float | None) -> str:
    return "not measured" if v is None else f"{v / 1e9:.2f} GB/s"


def _how(c: Any, key: str) -> str:
    """' (gpu-split)': how a figure was measured, where the file says."""
    return f" ({c.methods[key]})" if key in c.methods and getattr(c, key) is not None else ""


def calibrated_text(done: Any) -> str:
    c = done.calibration
    rows = [["fingerprint", c.fingerprint or "-"],
            ["CPU expert throughput", _rate(c.cpu_expert_bytes_per_s) + (f" at {c.threads} threads" if c.threads else "")
             + _how(c, "cpu_expert_bytes_per_s")],
            ["round trip per layer", ("not measured" if c.round_trip_s is None else f"{c.round_trip_s * 1e6:.0f} us")
             + _how(c, "round_trip_s")],
            ["host to device (pinned)", _rate(c.h2d_bytes_per_s)],
            ["prompt batch uploads", _rate(c.prompt_upload_bytes_per_s)],
            ["GPU on misses in RAM", _rate(c.gpu_miss_bytes_per_s)],
            *([["hop to a remote device", f"{c.rpc_hop_s * 1e6:.0f} us to {', '.join(c.rpc) or '?'}"]]
              if c.rpc_hop_s is not None else []),
            ["measured", c.measured_at or "-"],
            ["with", Path(c.model).name if c.model else "-"]]
    lines = [table(["calibration", ""], rows, "ll")]
    lines.append(f"{'reused' if done.reused else 'written'}: {done.path}")
    lines += [textwrap.fill(n, 80, initial_indent="note: ", subsequent_indent="      ") for n in c.notes]
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import calibrate_model

    out = Output.for_args(args)
    done = calibrate_model(args.model, threads=args.threads, force=args.force, progress=out.progress,
                           rpc=args.rpc or ())
    return out.result(done, calibrated_text)


def register(sub: Any) -> None:
    """calibrate."""
    p = sub.add_parser(
        "calibrate", help="measure this machine's CPU and bus for the planner (one file per machine)",
        description="Measure, with the model's own build, what the planner's costs are on this machine: the CPU's "
        "expert throughput at the server's threads, and with a GPU the host-to-device rate from pinned memory, a "
        "layer's round trip and a prompt batch's uploads (llama-bench, under a minute; with a GPU the CPU's rate "
        "and the round trip come from runs that move layers' experts and down projections between RAM and VRAM). Writes one JSON file per "
        "machine fingerprint (GPUs, driver, CPU, RAM, build) under the data dir's calibration/; a later run "
        "shows that file unless --force. Without a GPU the bus is not measured. With --rpc, also the hop to a remote "
        "device (the demo model with every layer on the first host's first device, against every layer here). "
        "Exit codes: 0 measured or "
        "reused, 1 an error (a failed run, a damaged file), 2 a usage error.")
    p.add_argument("model", nargs="?", default=None,
                   help="an installed model's name, or a model reference or path (default: the largest installed model; "
                        "with none installed, the demo model, whose figures install measures again with a real one)")
    p.add_argument("--threads", "-t", type=THREADS, default=None, metavar="N",
                   help="CPU threads to measure at, 1-4096 (default: the physical cores, llama.cpp's default)")
    p.add_argument("--force", action="store_true", help="measure again even where this machine has a file")
    p.add_argument("--rpc", type=RpcHosts(), metavar="HOST:PORT[,...]", default=None,
                   help="llama.cpp rpc-servers ('moeplug rpc-server' on the other machine): also measure the hop to "
                        "a remote device (rpc_hop_s, the planner's cost of each run of remote layers), to the first "
                        "of them; each must answer")
    add_json(p, "the calibration as JSON, with the file's path ('path') and whether it was reused ('reused')")
    p.set_defaults(func=cmd_calibrate)
