"""`moeplug profile MODEL`, `moeplug profile analyze FILE`, `moeplug profile merge OUT FILE...`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeplug.errors import EXIT_OK, EXIT_USAGE, MoeplugError
from moeplug.output import print_json, table

PROMPT_SETS_DEFAULT = "codeish,chatty"

USAGE = """moeplug profile MODEL [--prompts codeish,chatty] [-n 512] [--out FILE]
       moeplug profile --from-trace FILE --model MODEL [--prompts A:B] [--out FILE]
       moeplug profile analyze FILE [--slots 8,16,32] [--repick-every 64] [--model MODEL] [--json]
       moeplug profile merge OUT FILE [FILE ...]"""


def _slots(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        slots = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise MoeplugError(f"--slots: expected numbers like 8,16,32, got {text!r}", EXIT_USAGE) from exc
    if not slots or slots[0] < 1:
        raise MoeplugError("--slots: every slot count must be at least 1", EXIT_USAGE)
    return slots


def print_summary(analysis: Any, verbose: bool = False) -> None:
    from moeplug.profile.chart import coverage_chart

    a = analysis
    print(f"tokens: {a.tokens_prefill} prefill, {a.tokens_decode} decode; {len(a.layers)} MoE layers x "
          f"{a.n_expert} experts, {a.n_expert_used} used per token")
    if not any(layer.selections for layer in a.layers):
        print("no generated tokens recorded: nothing to score (profile with -n > 0)")
        return
    rows = []
    for n in a.slots:
        rates = [a.overall_hit_rate(p, n) for p in a.policies]
        rows.append([n, f"{100 * n / a.n_expert:.0f}%"] + [f"{100 * r:.1f}%" for r in rates])
    print("\nhit rate of N resident slots per layer (generated tokens, second half of each run):")
    print(table(["slots", "of experts", *a.policies], rows, "rr" + "r" * len(a.policies)))
    print()
    print(coverage_chart(a.slots, {p: [a.overall_hit_rate(p, n) for n in a.slots] for p in a.policies}))
    skews = [layer.skew() for layer in a.layers]
    ent = sum(s["entropy_norm"] for s in skews) / len(skews)
    top = sum(s["top10pct_share"] for s in skews) / len(skews)
    print(f"\nrouting skew: normalised entropy {ent:.3f} (1 = uniform), top 10% of experts take {100 * top:.1f}% "
          f"of selections (mean over layers)")
    if verbose:
        mid = a.slots[len(a.slots) // 2]
        rows = [[layer.tensor, f"{layer.skew()['entropy_norm']:.3f}"] +
                [f"{100 * (layer.hit_rate(p, mid) or 0):.1f}%" for p in a.policies] for layer in a.layers]
        print(f"\nper layer at {mid} slots:")
        print(table(["tensor", "entropy", *a.policies], rows, "lr" + "r" * len(a.policies)))


def cmd_profile(args: argparse.Namespace) -> int:
    items: list[str] = args.items
    if args.from_trace:
        if items:
            raise MoeplugError(f"profile --from-trace takes no MODEL argument (use --model); usage: {USAGE}", EXIT_USAGE)
        return _from_trace(args)
    if not items:
        raise MoeplugError(f"usage: {USAGE}", EXIT_USAGE)
    if items[0] == "analyze":
        return _analyze(args, items[1:])
    if items[0] == "merge":
        return _merge(args, items[1:])
    if len(items) != 1:
        raise MoeplugError(f"usage: {USAGE}", EXIT_USAGE)
    return _run(args, Path(items[0]))


def _analyze(args: argparse.Namespace, files: list[str]) -> int:
    from moeplug.profile import analyze, merge_profiles, model_fingerprint, read_profile

    if not files:
        raise MoeplugError("profile analyze: name a profile file", EXIT_USAGE)
    profile = merge_profiles([read_profile(f) for f in files])
    if args.model:
        profile.check_model(model_fingerprint(args.model))
    analysis = analyze(profile, _slots(args.slots), args.repick_every)
    if args.json:
        print_json(analysis.to_json())
    else:
        print_summary(analysis, verbose=args.verbose)
    return EXIT_OK


def _merge(args: argparse.Namespace, items: list[str]) -> int:
    from moeplug.profile import merge_profiles, read_profile, write_profile

    if len(items) < 2:
        raise MoeplugError("profile merge: give the output file, then the profiles to merge", EXIT_USAGE)
    out, inputs = Path(items[0]), items[1:]
    if out.exists() and not args.force:
        raise MoeplugError(f"{out} exists (use --force to replace it)")
    merged = merge_profiles([read_profile(f) for f in inputs])
    write_profile(merged, out)
    if args.json:
        print_json({"out": str(out), "sources": [s.label for s in merged.sources],
                    "tokens": {"prefill": merged.tokens(0), "decode": merged.tokens(1)}})
    else:
        print(f"wrote {out}: {len(merged.sources)} sources, {merged.tokens(1)} decode tokens")
    return EXIT_OK


def _from_trace(args: argparse.Namespace) -> int:
    from moeplug.profile import write_profile
    from moeplug.profile.from_trace import profile_from_trace_file
    from moeplug.profile.runner import default_profile_path

    if not args.model:
        raise MoeplugError("profile --from-trace: name the model the profile is for with --model", EXIT_USAGE)
    prompts = None if args.prompts == PROMPT_SETS_DEFAULT else args.prompts
    profile = profile_from_trace_file(args.from_trace, args.model, prompts)
    dest = Path(args.out) if args.out else default_profile_path(profile.fingerprint)
    write_profile(profile, dest)
    return _print_made(args, dest, profile, f" (from {profile.sources[0].label})")


def _print_made(args: argparse.Namespace, dest: Path, profile: Any, origin: str = "") -> int:
    """Where the new profile went, and its analysis."""
    from moeplug.profile import analyze

    analysis = analyze(profile, _slots(args.slots), args.repick_every)
    if args.json:
        print_json({"profile": str(dest), **analysis.to_json()})
    else:
        print(f"profile: {dest}{origin}")
        print_summary(analysis, verbose=args.verbose)
    return EXIT_OK


def _run(args: argparse.Namespace, model: Path) -> int:
    from moeplug.model_inspect import inspect_model
    from moeplug.native.build import build, resolve_options
    from moeplug.profile.runner import ProfileRun, run_profile

    inspect_model(model)  # a clear error now for a missing, damaged or dense model
    result = build(resolve_options(args.backend, stock=False, jobs=0, cuda_arch=None))
    tool = result.binary("llama-moe-profile")
    if not tool.exists():
        raise MoeplugError(f"build {result.build_id} has no llama-moe-profile; rebuild with 'moeplug native build'")
    extra = ["-ngl", str(args.ngl)] if args.ngl is not None else []
    if args.no_mtp:
        extra.append("--no-mtp")
    run = ProfileRun(tool=tool, model=model, n_predict=args.n_predict, ctx=args.ctx, threads=args.threads,
                     seed=args.seed, temp=args.temp, ignore_eos=args.ignore_eos, extra_args=tuple(extra))
    sets = [s.strip() for s in args.prompts.split(",") if s.strip()]
    dest, profile = run_profile(run, sets, Path(args.out) if args.out else None)
    return _print_made(args, dest, profile)


def add_profile_command(sub: Any) -> None:
    p = sub.add_parser("profile", help="record which experts the router picks; analyse and merge profiles",
                       usage=USAGE, description="Profile a model with bundled prompts (llama-moe-profile), or "
                       "analyse/merge profile files. Analysis: hit rate of N slots per layer for a static set, "
                       "the hindsight oracle, an LRU and periodic re-picking.")
    p.add_argument("items", nargs="*", metavar="MODEL | analyze FILE... | merge OUT FILE...")
    p.add_argument("--prompts", default=PROMPT_SETS_DEFAULT,
                   help="prompt sets: bundled names or .txt files; with --from-trace: a prompt range A:B of the trace")
    p.add_argument("--from-trace", metavar="FILE",
                   help="make the profile of --model from recorded routing (an npz trace or a route replay file)")
    p.add_argument("-n", "--n-predict", type=int, default=512, help="tokens generated per prompt")
    p.add_argument("--out", help="where to write the profile (default: under the user data dir, by model)")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--temp", type=float, default=0.0, help="0 = greedy; else sampled with --seed")
    p.add_argument("--ngl", type=int, default=None, help="GPU layers for the profiling run")
    p.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens per prompt")
    p.add_argument("--no-mtp", action="store_true", help="do not run the MTP (NextN) head of a model that has one")
    p.add_argument("--slots", help="slot counts to score, e.g. 8,16,32 (default: powers of two and eighths)")
    p.add_argument("--repick-every", type=int, default=64, help="K for the re-pick policy")
    p.add_argument("--model", help="analyze: check the profile belongs to this model; --from-trace: the model")
    p.add_argument("--force", action="store_true", help="merge: replace OUT")
    p.add_argument("--verbose", "-v", action="store_true", help="per-layer table")
    p.add_argument("--json", action="store_true")
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--cpu", dest="backend", action="store_const", const="cpu")
    backend.add_argument("--cuda", dest="backend", action="store_const", const="cuda")
    p.set_defaults(func=cmd_profile, backend=None)
