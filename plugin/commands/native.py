"""`moeplug native ...`: build, status and the developer loop."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeplug.commands.options import CUDA_ARCH, JOBS, add_backend, add_json
from moeplug.core.output import Output, human_bytes, table


def cmd_build(args: argparse.Namespace) -> int:
    from moeplug.native.build import build, resolve_options

    out = Output.for_args(args)
    result = build(resolve_options(args.backend, args.stock, args.jobs, args.cuda_arch, sanitize=args.sanitize),
                   progress=out.progress)
    doc = {"build_id": result.build_id, "path": str(result.path), "built": result.built, **result.manifest}
    return out.result(doc, lambda _: f"{'built' if result.built else 'already built'}: {result.build_id}\n"
                                     f"  {result.bin_dir}")


def _features_text(features: dict[str, bool]) -> str:
    return ", ".join(name for name, on in features.items() if on) or "-"


@dataclass
class Builds:
    builds: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"builds": self.builds}


def builds_text(listing: Builds) -> str:
    docs = listing.builds
    if not docs:
        return "no native builds yet: run 'moeplug native build'"
    rows = [[d["build_id"], d["backend"], ("stock" if d["stock"] else "patched") + (", ASan+UBSan" if d.get("sanitize") else ""),
             d["llama_cpp_tag"],
             "current" if d["current"] else "stale", d.get("created", "?"), _features_text(d.get("features", {}))]
            for d in docs]
    text = table(["build", "backend", "kind", "llama.cpp", "state", "created", "features"], rows, "lllllll")
    if not all(d["current"] for d in docs):
        text += "\nstale: built from another patch series or overlay; 'moeplug native prune' removes them"
    return text


def cmd_status(args: argparse.Namespace) -> int:
    from moeplug.native.build import installed_builds, is_current
    from moeplug.native.features import detect_features

    out = Output.for_args(args)
    if args.binary:
        features = detect_features(Path(args.binary))
        return out.result({"binary": args.binary, "features": features},
                          lambda _: f"{args.binary}\n  features: {_features_text(features)}")
    docs = [{**b.manifest, "path": str(b.path), "usable": b.binary("llama-server").exists(), "current": is_current(b)}
            for b in installed_builds()]
    return out.result(Builds(docs), builds_text)


@dataclass
class Pruned:
    removed: list[Path]
    bytes: int
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {"removed": [str(p) for p in self.removed], "bytes": self.bytes, "dry_run": self.dry_run}


def pruned_text(r: Pruned) -> str:
    verb = "would remove" if r.dry_run else "removed"
    return "\n".join([f"{verb} {p}" for p in r.removed] + [f"{verb} {len(r.removed)} folders, {human_bytes(r.bytes)}"])


def cmd_prune(args: argparse.Namespace) -> int:
    from moeplug.native.build import prune

    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())

    removed = prune(dry_run=True)
    freed = sum(size(p) for p in removed)
    if not args.dry_run:
        prune()
    return Output.for_args(args).result(Pruned(removed, freed, args.dry_run), pruned_text)


def cmd_worktree(args: argparse.Namespace) -> int:
    from moeplug.native.devloop import make_worktree

    tree = make_worktree(Path(args.dir))
    return Output().result(tree, lambda t: f"work tree ready: {t}\n  edit and commit there, then: "
                                           f"moeplug native export {t}")


def cmd_export(args: argparse.Namespace) -> int:
    from moeplug.native.devloop import export_patches

    patches = export_patches(Path(args.dir))
    return Output().result(patches, lambda ps: "\n".join([f"wrote {len(ps)} patches:"] + [f"  {p.name}" for p in ps]))


def cmd_check_series(args: argparse.Namespace) -> int:
    from moeplug.native.series import check_limits, load_limits, measure_series, report_text, write_limits

    out = Output.for_args(args)
    report = measure_series()
    if args.write_limits:
        write_limits(report)
    limits = load_limits()
    over = check_limits(report, limits)
    out.result({**report.to_json(), "limits": limits, "over": over}, lambda _: report_text(report, limits))
    return 1 if over else 0


def register(sub: Any) -> None:
    """native build, status, prune, worktree, export, check-series."""
    group = sub.add_parser("native", help="build and inspect the patched llama.cpp")
    native = group.add_subparsers(dest="native_command", metavar="NATIVE_COMMAND", required=True,
                                  parser_class=type(group))
    p = native.add_parser("build", help="build llama.cpp (pinned, patched or --stock) offline, once per build id")
    add_backend(p)
    p.add_argument("--stock", action="store_true", help="unpatched llama.cpp: the reference for exactness and speed")
    p.add_argument("--sanitize", action="store_true",
                   help="a CPU build under AddressSanitizer and UndefinedBehaviorSanitizer (-O1), of llama-server "
                        "(and llama-moe-profile when patched) only, under its own build id (suffix -asan): what the "
                        "hostile-file tests run")
    p.add_argument("--jobs", "-j", type=JOBS, default=0, help="parallel compile jobs (default 0: one per core)")
    p.add_argument("--cuda-arch", type=CUDA_ARCH,
                   help="CUDA architecture, e.g. 90 (default: the GPU's compute capability)")
    add_json(p)
    p.set_defaults(func=cmd_build)

    p = native.add_parser("status", help="list native builds and what each supports")
    p.add_argument("--binary", help="report the features of this llama-server instead (any build)")
    add_json(p)
    p.set_defaults(func=cmd_status)

    p = native.add_parser("prune", help="remove stale builds and source trees (another patch series or overlay)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    add_json(p)
    p.set_defaults(func=cmd_prune)

    p = native.add_parser("worktree", help="make a git work tree of the pinned source with our patches as commits")
    p.add_argument("dir")
    p.set_defaults(func=cmd_worktree)

    p = native.add_parser("export", help="regenerate native/patches (and overlay files) from a work tree")
    p.add_argument("dir")
    p.set_defaults(func=cmd_export)

    p = native.add_parser("check-series",
                          help="apply the patch series to the pinned tree and print what it changes in each upstream "
                               "file, against native/series-limits.yaml (exit 1 above a limit)")
    p.add_argument("--write-limits", action="store_true",
                   help="write the series' figures into native/series-limits.yaml first (after a change lowered them)")
    add_json(p)
    p.set_defaults(func=cmd_check_series)
