"""`moeplug native ...`: build, status and the developer loop."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeplug.errors import EXIT_OK
from moeplug.output import print_json, table


def cmd_build(args: argparse.Namespace) -> int:
    from moeplug.native.build import build, resolve_options

    opts = resolve_options(args.backend, args.stock, args.jobs, args.cuda_arch)
    result = build(opts)
    if args.json:
        print_json({"build_id": result.build_id, "path": str(result.path), "built": result.built, **result.manifest})
    else:
        state = "built" if result.built else "already built"
        print(f"{state}: {result.build_id}\n  {result.bin_dir}")
    return EXIT_OK


def _features_text(features: dict[str, bool]) -> str:
    return ", ".join(name for name, on in features.items() if on) or "-"


def cmd_status(args: argparse.Namespace) -> int:
    from moeplug.native.build import installed_builds, is_current
    from moeplug.native.features import detect_features

    if args.binary:
        features = detect_features(Path(args.binary))
        if args.json:
            print_json({"binary": args.binary, "features": features})
        else:
            print(f"{args.binary}\n  features: {_features_text(features)}")
        return EXIT_OK
    builds = installed_builds()
    docs: list[dict[str, Any]] = []
    for b in builds:
        server = b.binary("llama-server")
        docs.append({**b.manifest, "path": str(b.path), "usable": server.exists(), "current": is_current(b)})
    if args.json:
        print_json({"builds": docs})
        return EXIT_OK
    if not docs:
        print("no native builds yet: run 'moeplug native build'")
        return EXIT_OK
    rows = [[d["build_id"], d["backend"], "stock" if d["stock"] else "patched", d["llama_cpp_tag"],
             "current" if d["current"] else "stale", d.get("created", "?"), _features_text(d.get("features", {}))]
            for d in docs]
    print(table(["build", "backend", "kind", "llama.cpp", "state", "created", "features"], rows, "lllllll"))
    if not all(d["current"] for d in docs):
        print("stale: built from another patch series or overlay; 'moeplug native prune' removes them")
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    from moeplug.native.build import prune
    from moeplug.output import human_bytes

    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())

    removed = prune(dry_run=True)
    freed = sum(size(p) for p in removed)
    if not args.dry_run:
        prune()
    if args.json:
        print_json({"removed": [str(p) for p in removed], "bytes": freed, "dry_run": args.dry_run})
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for p in removed:
        print(f"{verb} {p}")
    print(f"{verb} {len(removed)} folders, {human_bytes(freed)}")
    return EXIT_OK


def cmd_worktree(args: argparse.Namespace) -> int:
    from moeplug.native.devloop import make_worktree

    tree = make_worktree(Path(args.dir))
    print(f"work tree ready: {tree}\n  edit and commit there, then: moeplug native export {tree}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from moeplug.native.devloop import export_patches

    patches = export_patches(Path(args.dir))
    print(f"wrote {len(patches)} patches:")
    for p in patches:
        print(f"  {p.name}")
    return EXIT_OK


def add_native_commands(sub: Any) -> None:
    native = sub.add_parser("native", help="build and inspect the patched llama.cpp").add_subparsers(
        dest="native_command", metavar="NATIVE_COMMAND", required=True, parser_class=sub._parser_class
    )
    p = native.add_parser("build", help="build llama.cpp (pinned, patched or --stock) offline, once per build id")
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--cpu", dest="backend", action="store_const", const="cpu", help="force a CPU build")
    backend.add_argument("--cuda", dest="backend", action="store_const", const="cuda", help="force a CUDA build")
    p.add_argument("--stock", action="store_true", help="unpatched llama.cpp: the reference for exactness and speed")
    p.add_argument("--jobs", "-j", type=int, default=0, help="parallel compile jobs (default: one per core)")
    p.add_argument("--cuda-arch", help="CUDA architecture, e.g. 90 (default: the GPU's compute capability)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_build, backend=None)

    p = native.add_parser("status", help="list native builds and what each supports")
    p.add_argument("--binary", help="report the features of this llama-server instead (any build)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = native.add_parser("prune", help="remove stale builds and source trees (another patch series or overlay)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prune)

    p = native.add_parser("worktree", help="make a git work tree of the pinned source with our patches as commits")
    p.add_argument("dir")
    p.set_defaults(func=cmd_worktree)

    p = native.add_parser("export", help="regenerate native/patches (and overlay files) from a work tree")
    p.add_argument("dir")
    p.set_defaults(func=cmd_export)
