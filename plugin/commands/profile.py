"""`moeplug profile [run] MODEL`, `moeplug profile analyze FILE...`, `moeplug profile merge OUT FILE...`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeplug.core.errors import EXIT_USAGE, MoeplugError
from moeplug.commands.options import COUNT, CTX, LAYERS, SEED, SLOTS, TEMPERATURE, THREADS, TOKENS, add_backend, add_json
from moeplug.core.output import Output, table

PROMPT_SETS_DEFAULT = "codeish,chatty"
SUBCOMMANDS = ("run", "analyze", "merge")
DEFAULT_SUBCOMMAND = "run"  # `moeplug profile MODEL` (moeplug.commands.main.default_subcommands)


def summary_text(analysis: Any, verbose: bool = False) -> str:
    from moeplug.profile.chart import coverage_chart

    a = analysis
    lines: list[str] = []
    add = lines.append
    add(f"tokens: {a.tokens_prefill} prefill, {a.tokens_decode} decode; {len(a.layers)} MoE layers x "
        f"{a.n_expert} experts, {a.n_expert_used} used per token")
    if not any(layer.selections for layer in a.layers):
        add("no generated tokens recorded: nothing to score (profile with -n > 0)")
        return "\n".join(lines)
    rows = []
    for n in a.slots:
        rates = [a.overall_hit_rate(p, n) for p in a.policies]
        rows.append([n, f"{100 * n / a.n_expert:.0f}%"] + [f"{100 * r:.1f}%" for r in rates])
    add("")
    add("hit rate of N resident slots per layer (generated tokens, second half of each run):")
    add(table(["slots", "of experts", *a.policies], rows, "rr" + "r" * len(a.policies)))
    add("")
    add(coverage_chart(a.slots, {p: [a.overall_hit_rate(p, n) for n in a.slots] for p in a.policies}))
    skews = [layer.skew() for layer in a.layers]
    ent = sum(s["entropy_norm"] for s in skews) / len(skews)
    top = sum(s["top10pct_share"] for s in skews) / len(skews)
    add("")
    add(f"routing skew: normalised entropy {ent:.3f} (1 = uniform), top 10% of experts take {100 * top:.1f}% "
        f"of selections (mean over layers)")
    if verbose:
        mid = a.slots[len(a.slots) // 2]
        rows = [[layer.tensor, f"{layer.skew()['entropy_norm']:.3f}"] +
                [f"{100 * (layer.hit_rate(p, mid) or 0):.1f}%" for p in a.policies] for layer in a.layers]
        add("")
        add(f"per layer at {mid} slots:")
        add(table(["tensor", "entropy", *a.policies], rows, "lr" + "r" * len(a.policies)))
    return "\n".join(lines)


def cmd_analyze(args: argparse.Namespace) -> int:
    from moeplug.profile import analyze, merge_profiles, model_fingerprint, read_profile

    profile = merge_profiles([read_profile(f) for f in args.files])
    if args.model:
        profile.check_model(model_fingerprint(args.model))
    analysis = analyze(profile, args.slots, args.repick_every)
    return Output.for_args(args).result(analysis, lambda a: summary_text(a, verbose=args.verbose))


@dataclass
class Merged:
    out: Path
    profile: Any  # moeplug.profile.Profile

    def to_json(self) -> dict[str, Any]:
        m = self.profile
        return {"out": str(self.out), "sources": [s.label for s in m.sources],
                "tokens": {"prefill": m.tokens(0), "decode": m.tokens(1)}}


def cmd_merge(args: argparse.Namespace) -> int:
    from moeplug.profile import merge_profiles, read_profile, write_profile

    out = Path(args.out)
    if out.exists() and not args.force:
        raise MoeplugError(f"{out} exists (use --force to replace it)")
    merged = merge_profiles([read_profile(f) for f in args.files])
    write_profile(merged, out)
    return Output.for_args(args).result(Merged(out, merged), lambda r: (
        f"wrote {r.out}: {len(r.profile.sources)} sources, {r.profile.tokens(1)} decode tokens"))


def cmd_run(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import profile

    if args.from_trace:
        return _from_trace(args)
    if not args.model:
        raise MoeplugError("profile: name the MODEL to profile (or --from-trace FILE --model MODEL)", EXIT_USAGE)
    if args.for_model:
        raise MoeplugError("profile: --model goes with --from-trace (the model to profile is the MODEL argument)",
                           EXIT_USAGE)
    out = Output.for_args(args)
    done = profile(Path(args.model), prompt_sets=[s.strip() for s in args.prompts.split(",") if s.strip()],
                   out=Path(args.out) if args.out else None, backend=args.backend, n_predict=args.n_predict,
                   ctx=args.ctx, ctx_override=args.ctx_override, threads=args.threads, seed=args.seed,
                   temp=args.temp, ngl=args.ngl, ignore_eos=args.ignore_eos, mtp=not args.no_mtp, slots=args.slots,
                   repick_every=args.repick_every, progress=out.progress)
    return out.result(done, lambda d: f"profile: {d.path}\n" + summary_text(d.analysis, verbose=args.verbose))


def _from_trace(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import profile_from_trace

    if args.model:
        raise MoeplugError("profile --from-trace takes no MODEL argument (name the model with --model)", EXIT_USAGE)
    if not args.for_model:
        raise MoeplugError("profile --from-trace: name the model the profile is for with --model", EXIT_USAGE)
    out = Output.for_args(args)
    prompts = None if args.prompts == PROMPT_SETS_DEFAULT else args.prompts
    done = profile_from_trace(args.from_trace, args.for_model, prompts, Path(args.out) if args.out else None,
                              args.slots, args.repick_every)
    return out.result(done, lambda d: f"profile: {d.path} (from {d.source})\n"
                      + summary_text(d.analysis, verbose=args.verbose))


def _analysis_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=SLOTS, help="slot counts to score, e.g. 8,16,32 (default: powers of two and eighths)")
    p.add_argument("--repick-every", type=COUNT, default=64, help="K for the re-pick policy")
    p.add_argument("--verbose", "-v", action="store_true", help="per-layer table")
    add_json(p)


def register(sub: Any) -> None:
    """profile run (the default: `moeplug profile MODEL`), profile analyze, profile merge."""
    group = sub.add_parser(
        "profile", help="record which experts the router picks; analyse and merge profiles",
        description="Profile a model with bundled prompts (llama-moe-profile): 'moeplug profile MODEL' is "
        "'moeplug profile run MODEL'; or analyse/merge profile files. Analysis: hit rate of N slots per layer for "
        "a static set, the hindsight oracle, an LRU and periodic re-picking.")
    profile_sub = group.add_subparsers(dest="profile_command", metavar="{run,analyze,merge}", required=True,
                                       parser_class=type(group))

    p = profile_sub.add_parser("run", help="profile MODEL with prompt sets (the default subcommand), or make a "
                               "profile from recorded routing (--from-trace FILE --model MODEL)")
    p.add_argument("model", nargs="?", help="the model to profile (none with --from-trace)")
    p.add_argument("--prompts", default=PROMPT_SETS_DEFAULT,
                   help="prompt sets: bundled names or .txt files; with --from-trace: a prompt range A:B of the trace")
    p.add_argument("--from-trace", metavar="FILE",
                   help="make the profile of --model from recorded routing (an npz trace or a route replay file)")
    p.add_argument("--model", dest="for_model", metavar="MODEL", help="--from-trace: the model the profile is for")
    p.add_argument("-n", "--n-predict", type=TOKENS, default=512, help="tokens generated per prompt (0: prompts only)")
    p.add_argument("--out", help="where to write the profile (default: under the user data dir, by model)")
    p.add_argument("--ctx", type=CTX, help="context size (default 4096, or the model's training context when smaller)")
    p.add_argument("--ctx-override", action="store_true", help="allow a --ctx above the model's training context")
    p.add_argument("--threads", "-t", type=THREADS, default=None)
    p.add_argument("--seed", type=SEED, default=42, help="sampling seed, 0-4294967295")
    p.add_argument("--temp", type=TEMPERATURE, default=0.0, help="0 = greedy; else sampled with --seed")
    p.add_argument("--ngl", type=LAYERS, default=None, help="GPU layers for the profiling run (0: none)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens per prompt")
    p.add_argument("--no-mtp", action="store_true", help="do not run the MTP (NextN) head of a model that has one")
    add_backend(p, "build")
    _analysis_options(p)
    p.set_defaults(func=cmd_run)

    p = profile_sub.add_parser("analyze", help="hit rate of N slots per layer: static, oracle, LRU, re-pick")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--model", help="check the profile belongs to this model")
    _analysis_options(p)
    p.set_defaults(func=cmd_analyze)

    p = profile_sub.add_parser("merge", help="merge profiles of one model (counts add, sources kept)")
    p.add_argument("out", metavar="OUT")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--force", action="store_true", help="replace OUT")
    add_json(p)
    p.set_defaults(func=cmd_merge)
