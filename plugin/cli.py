"""The `moeplug` command line: argument parsing and printing only; the work is in the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from moeplug import __version__
from moeplug.errors import (
    EXIT_BUILD_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOT_APPLICABLE,
    EXIT_OK,
    EXIT_USAGE,
    MoeplugError,
)
from moeplug.output import ProgressBar, human_bytes, print_json, table

EPILOG = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_ERROR}    error (bad input, missing file, failed command)
  {EXIT_USAGE}    usage error (unknown option, missing argument)
  {EXIT_NOT_APPLICABLE}    not applicable: a dense model, or a plan that does not fit
  {EXIT_BUILD_FAILED}    native build failed (the message names the log file)
  {EXIT_INTERRUPTED}  interrupted
"""


class _Parser(argparse.ArgumentParser):
    """argparse that prints one line (not the whole usage) on a usage error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"moeplug: error: {message} (see '{self.prog} --help')\n")


# ---------------------------------------------------------------------------------------------
# inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    from moeplug.model_inspect import inspect_model

    info = inspect_model(args.model)
    if args.json:
        print_json(info.to_json())
        return EXIT_OK
    dense = [b for b in range(info.n_layer) if b not in set(info.moe_layers)]
    print(f"{info.path}" + (f"  ({len(info.shards)} shards)" if len(info.shards) > 1 else ""))
    print(f"  architecture     {info.arch}" + (f"  ({info.name})" if info.name else ""))
    print(f"  blocks           {info.n_layer}  (MoE: {len(info.moe_layers)}, dense: {len(dense)})")
    print(f"  experts          {info.n_expert}, {info.n_expert_used} used per token, {info.n_expert_shared} shared")
    if info.expert_ff:
        print(f"  expert ff        {info.expert_ff}")
    quants = ", ".join(f"{k} {human_bytes(v)}" for k, v in info.quant_bytes(experts_only=True).items())
    print(f"  expert types     {quants}")
    print(f"  expert bytes     {human_bytes(info.expert_bytes)}  ({info.expert_bytes} B)")
    print(f"  non-expert bytes {human_bytes(info.non_expert_bytes)}  ({info.non_expert_bytes} B)")
    print(f"  total            {human_bytes(info.total_bytes)}  ({info.total_bytes} B)")
    print()
    keys = sorted({k for layer in info.layers for k in layer.tensors})
    rows = [
        [layer.block, layer.n_expert, layer.bytes_per_expert]
        + [layer.tensors[k].n_bytes if k in layer.tensors else "-" for k in keys]
        + [human_bytes(layer.expert_bytes)]
        for layer in info.layers
    ]
    print(table(["block", "experts", "B/expert", *keys, "layer total"], rows, "rrr" + "r" * len(keys) + "r"))
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# resolve, recipes


def cmd_resolve(args: argparse.Namespace) -> int:
    from moeplug.refs import resolve_ref

    resolved = resolve_ref(args.model)
    if args.json:
        print_json(resolved.to_json())
        return EXIT_OK
    ref = resolved.ref
    print(f"{ref.text}: {ref.kind}" + (f" (recipe {ref.recipe.name})" if ref.recipe else ""))
    if ref.repo:
        print(f"  repo      {ref.repo}" + (f"  quant {ref.quant}" if ref.quant else f"  file {ref.filename}"))
    if resolved.revision:
        print(f"  revision  {resolved.revision}")
    print(f"  source    {resolved.source}")
    print(f"  path      {resolved.path}")
    for extra in resolved.files[1:]:
        print(f"            {extra}")
    return EXIT_OK


def cmd_recipes(args: argparse.Namespace) -> int:
    from moeplug.refs import load_recipes

    recipes = {r.name: r for r in load_recipes().values()}
    if args.json:
        print_json([{"name": r.name, "aliases": list(r.aliases), "repo": r.repo, "quant": r.quant, "arch": r.arch,
                     "checked": r.checked, "notes": r.notes} for r in recipes.values()])
        return EXIT_OK
    rows = [[r.name, r.repo + ("" if r.checked else " (unconfirmed)"), r.quant, r.arch] for r in recipes.values()]
    print(table(["recipe", "repo", "quant", "arch"], rows, "llll"))
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# dev make-model


def cmd_make_model(args: argparse.Namespace) -> int:
    from moeplug.synth import ModelSpec, make_model, shape_spec

    if args.shape:
        spec = shape_spec(args.shape, args.seed if args.seed is not None else 1234)
    else:
        spec = ModelSpec(
            arch=args.arch, layers=args.layers, experts=args.experts, used=args.used, embd=args.embd,
            expert_ff=args.expert_ff, heads=args.heads, heads_kv=args.heads_kv, head_dim=args.head_dim,
            dtype=args.dtype, expert_dtype=args.expert_dtype, seed=args.seed if args.seed is not None else 1234, ctx=args.ctx,
            leading_dense=args.leading_dense, expert_scales=args.expert_scales, tied=args.tied,
            mtp_layers=args.mtp_layers,
            vocab_size=args.vocab_size,
        )
    bar = ProgressBar(f"writing {Path(args.out).name}", "B")
    try:
        files = make_model(spec, args.out, shards=args.shards, vocab_path=args.vocab, progress=bar.update)
    except ValueError as exc:
        raise MoeplugError(str(exc), EXIT_USAGE) from exc
    finally:
        bar.close()
    if args.json:
        print_json({"files": [str(f) for f in files], "arch": spec.arch, "dtype": spec.dtype, "seed": spec.seed})
    else:
        for f in files:
            print(f"wrote {f} ({human_bytes(f.stat().st_size)})")
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# parser


def _add_make_model(dev: Any) -> None:
    from moeplug.synth import SHAPES
    from moeplug.synth.archs import ARCHS, DTYPES

    p = dev.add_parser(
        "make-model",
        help="write a random-weight synthetic MoE GGUF (deterministic per seed)",
        description="Write a random-weight MoE model that stock llama.cpp loads. Same options and "
        "seed give a byte-identical file.",
    )
    p.add_argument("--out", required=True, help="output .gguf path (with --shards: NAME-0000i-of-0000N.gguf)")
    p.add_argument("--arch", choices=ARCHS, default="qwen3moe",
                   help="qwen3moe: separate gate/up/down; hy_v3: fused gate_up + shared expert + "
                   "leading dense block; gpt-oss: expert biases")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--used", type=int, default=4, help="experts used per token")
    p.add_argument("--embd", type=int, default=256, help="n_embd")
    p.add_argument("--expert-ff", type=int, default=128, help="expert feed-forward length")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ctx", type=int, default=4096, help="training context length written in the metadata")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32",
                   help="type of the weight matrices (norms, router and biases stay F32)")
    p.add_argument("--expert-dtype", choices=list(DTYPES), default=None,
                   help="type of the routed experts' matrices (default: --dtype; gpt-oss ships mxfp4)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 1234)")
    p.add_argument("--leading-dense", type=int, default=None,
                   help="hy_v3: dense blocks before the MoE ones (default 1)")
    p.add_argument("--expert-scales", action="store_true", help="qwen3moe: add per-expert scale tensors")
    p.add_argument("--mtp-layers", type=int, default=0, help="hy_v3: MTP (NextN) blocks after the trunk")
    p.add_argument("--tied", action="store_true", help="no output.weight: the output shares token_embd")
    p.add_argument("--shards", type=int, default=1, help="write a split GGUF of this many shards")
    p.add_argument("--vocab", help="copy the tokenizer of this vocab GGUF instead of the built-in byte-level BPE")
    p.add_argument("--vocab-size", type=int, default=None, help="pad the built-in vocab to this many tokens")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--shape", choices=list(SHAPES),
                       help="a real model's shape (ignores the shape options): qwen3-30b-a3b (48 layers x 128 experts, "
                       "8 used, Q4_K, about 16 GiB: the GPU benchmark model), gpt-oss-20b (24 x 32, 4 used, experts "
                       "MXFP4, the rest F16, about 13 GiB)")
    shape.add_argument("--benchmark-shape", dest="shape", action="store_const", const="qwen3-30b-a3b",
                       help="the same as --shape qwen3-30b-a3b")
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    p.set_defaults(func=cmd_make_model)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moeplug",
        description="Run big Mixture-of-Experts GGUF models fast on one GPU with profiled expert slots.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moeplug {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("inspect", help="show a GGUF MoE model's experts, layers and bytes (reads only the header)")
    p.add_argument("model", help="path to a .gguf file (any shard of a split model)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("resolve", help="where a model reference is on this machine (HF cache, Ollama, path)",
                       description="Resolve demo, a .gguf path, user/repo[:QUANT], user/repo/file.gguf, "
                       "ollama:NAME[:TAG] or a recipe name to local files, without downloading.")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser("recipes", help="list the known MoE models (recipes/*.yaml)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_recipes)

    dev = sub.add_parser("dev", help="developer tools: synthetic models").add_subparsers(
        dest="dev_command", metavar="DEV_COMMAND", parser_class=_Parser, required=True
    )
    _add_make_model(dev)

    from moeplug.hooks.cli import add_hook_commands
    from moeplug.install_cli import add_install_commands
    from moeplug.native.cli import add_native_commands
    from moeplug.profile.cli import add_profile_command
    from moeplug.trace_cli import add_trace_command
    from moeplug.tui.cli import add_tui_command

    add_install_commands(sub)
    add_profile_command(sub)
    add_trace_command(sub)
    add_native_commands(sub)
    add_hook_commands(sub)
    add_tui_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except MoeplugError as exc:
        if args.debug:
            raise
        print(f"moeplug: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("moeplug: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        sys.stderr.close()
        return EXIT_OK
    except Exception as exc:  # anything unexpected: still one line, the traceback behind --debug
        if args.debug:
            raise
        print(f"moeplug: error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
