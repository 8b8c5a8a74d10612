"""`moeplug trace convert IN.npz OUT` and `moeplug trace info FILE`: printing only (moeplug.profile.trace works)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.commands.options import EXPERTS, add_json
from moeplug.core.output import Output, human_bytes, table


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    lengths = doc["prompt_tokens"]
    return [f"  prompts   {doc['n_prompts']} ({lengths['min']}-{lengths['max']} tokens, median {lengths['median']:g})",
            f"  tokens    {doc['n_tokens']}",
            f"  layout    {doc['n_layer']} layers x {doc['n_expert_used']} of {doc['n_expert']} experts"
            + (", with weights" if doc["weights"] else ", no weights"),
            f"  source    {doc['source']}"]


def cmd_convert(args: argparse.Namespace) -> int:
    from moeplug.profile.trace import load_trace, write_replay

    out = Path(args.out)
    if out.exists() and not args.force:
        raise MoeplugError(f"{out} exists (use --force to replace it)")
    trace = load_trace(args.input, args.n_expert).select(args.prompts)
    write_replay(trace, out, weights=not args.no_weights)
    doc = {"out": str(out), "bytes": out.stat().st_size, **trace.summary(),
           "weights": trace.weights is not None and not args.no_weights}
    return Output.for_args(args).result(
        doc, lambda d: f"wrote {out} ({human_bytes(d['bytes'])})\n" + "\n".join(_summary_lines(d)))


def cmd_info(args: argparse.Namespace) -> int:
    from moeplug.profile.trace import load_trace

    trace = load_trace(args.file, args.n_expert).select(args.prompts)
    doc = {"file": str(args.file), **trace.summary()}
    counts = trace.counts()
    top = max(1, trace.n_expert // 4)
    top_share = trace.top_share(top)
    doc["top_quarter_share"] = [float(x) for x in top_share]
    doc["counts"] = counts.tolist()

    def text(d: dict[str, Any]) -> str:
        rows = [[layer, f"{100 * s:.1f}%", int(c.max()), int(c.min())]
                for layer, (s, c) in enumerate(zip(top_share, counts))]
        return "\n".join([str(args.file), *_summary_lines(d), "",
                          f"per layer: share of selections its top {top} experts take (a static {top}-slot set's best case)",
                          table(["layer", f"top {top}", "most", "least"], rows, "rrrr")])

    return Output.for_args(args).result(doc, text)


def add_trace_command(sub: Any) -> None:
    trace = sub.add_parser("trace", help="recorded router decisions: convert to a route replay file, show one",
                           description="Routing traces (npz: experts, probs, offsets) and route replay files "
                           "(native/REPLAY-FORMAT.md, for llama.cpp's --moe-route-replay).")
    tsub = trace.add_subparsers(dest="trace_command", metavar="TRACE_COMMAND", required=True,
                                parser_class=type(trace))
    p = tsub.add_parser("convert", help="write the route replay file of an npz trace (or of a replay file's prompts)")
    p.add_argument("input", metavar="IN", help="an npz trace (experts, probs, offsets) or a route replay file")
    p.add_argument("out", metavar="OUT", help="the replay file to write (.gguf)")
    p.add_argument("--prompts", help="prompt range A:B, python-slice style (0:400, 400:, --prompts=-100:); default all")
    p.add_argument("--no-weights", action="store_true",
                   help="leave out replay.weights: the model weights the replayed experts with its own router")
    p.add_argument("--n-expert", type=EXPERTS, help="experts per layer of the recorded model (default: highest id + 1)")
    p.add_argument("--force", action="store_true", help="replace OUT")
    add_json(p)
    p.set_defaults(func=cmd_convert)

    p = tsub.add_parser("info", help="check a trace or replay file and show its prompts, layout and skew")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--prompts", help="prompt range A:B; default all")
    p.add_argument("--n-expert", type=EXPERTS, help="npz: experts per layer (default: highest id + 1)")
    p.add_argument("--json", action="store_true", help="machine-readable, with per-layer counts")
    p.set_defaults(func=cmd_info)


register = add_trace_command  # moeplug.commands.main.COMMAND_MODULES
