"""The developer loop: a git work tree of the pinned source with our patches as commits.

    moeplug native worktree ~/src/llama-moeplug     # base commit, overlay commit, one per patch
    ... edit, commit (one logical change per commit) ...
    moeplug native export ~/src/llama-moeplug       # regenerate native/patches and native/overlay

Files of ours that llama.cpp does not have live in native/overlay (mirroring tree paths) and are
never part of a patch; patches only change upstream files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.native.lock import NativeSpec, load_spec, native_dir
from moeplug.native.source import apply_overlay, extract_sdist, fetch_sdist
from moeplug.core.paths import logs_dir

BASE_TAG = "moeplug-base"
OVERLAY_TAG = "moeplug-overlay"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "moeplug", "GIT_AUTHOR_EMAIL": "moeplug@localhost",
    "GIT_COMMITTER_NAME": "moeplug", "GIT_COMMITTER_EMAIL": "moeplug@localhost",
}


def _git(tree: Path, *args: str) -> str:
    env = dict(os.environ, **_GIT_ENV, GIT_CEILING_DIRECTORIES=str(tree.parent))
    proc = subprocess.run(["git", *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MoeplugError(f"git {' '.join(args[:2])} failed in {tree}: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def make_worktree(dest: Path, spec: NativeSpec | None = None) -> Path:
    spec = spec or load_spec()
    if dest.exists() and any(dest.iterdir()):
        raise MoeplugError(f"{dest}: exists and is not empty")
    logs_dir().mkdir(parents=True, exist_ok=True)
    log = logs_dir() / "native-worktree.log"
    dest.mkdir(parents=True, exist_ok=True)
    extract_sdist(fetch_sdist(spec.lock, log), spec.lock, dest)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", f"llama.cpp {spec.lock.tag} (pinned upstream)")
    _git(dest, "tag", BASE_TAG)
    apply_overlay(spec, dest)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "--allow-empty", "-m", "moeplug: our own files (native/overlay)")
    _git(dest, "tag", OVERLAY_TAG)
    for patch in spec.patches:
        _git(dest, "am", "-q", "--3way", str(patch))
    return dest


def export_patches(tree: Path, spec: NativeSpec | None = None, root: Path | None = None) -> list[Path]:
    """Copy overlay files back from the work tree and rewrite native/patches from its commits."""
    root = root or native_dir()
    spec = spec or load_spec(root)
    if not (tree / ".git").exists():
        raise MoeplugError(f"{tree}: not a work tree made by 'moeplug native worktree'")
    _git(tree, "rev-parse", OVERLAY_TAG)
    overlay_files = [str(p) for p in spec.overlay_files]
    for rel in overlay_files:
        if (tree / rel).exists():
            shutil.copy2(tree / rel, spec.overlay_dir / rel)
    patches_dir = root / "patches"
    staging = root / ".patches.new"
    shutil.rmtree(staging, ignore_errors=True)
    excludes = [f":(exclude){rel}" for rel in overlay_files]
    _git(tree, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat", "--no-numbered",
         "-o", str(staging), f"{OVERLAY_TAG}..HEAD", "--", ".", *excludes)
    # swap the new series in only once it is complete
    old = root / ".patches.old"
    shutil.rmtree(old, ignore_errors=True)
    if patches_dir.exists():
        os.replace(patches_dir, old)
    os.replace(staging, patches_dir)
    shutil.rmtree(old, ignore_errors=True)
    return sorted(patches_dir.glob("*.patch"))
