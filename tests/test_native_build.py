"""The native build: real llama.cpp builds (CPU), served on loopback with real models.

The first run builds the patched and the stock flavour (about 5 min each on 2 cores); later
runs find them installed under the same build ids and build nothing.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import run_cli
from moeplug.core.errors import BuildError
from moeplug.native.build import build, build_id
from moeplug.native.lock import NativeSpec, load_spec
from moeplug.native.source import prepare_tree, sdist_path
from moeplug.serving.server import start_server

pytestmark = pytest.mark.native

PROMPT = "Once upon a time, in a land of many experts,"


@pytest.mark.parametrize("flavour", ["patched", "stock"])
@pytest.mark.parametrize("arch", ["qwen3moe", "hy_v3", "gpt-oss"])
def test_server_loads_serves_and_is_deterministic(request, tmp_path: Path, fixture_models, arch: str,
                                                  flavour: str) -> None:
    result = request.getfixturevalue(f"{flavour}_build")
    with start_server(result.binary("llama-server"), fixture_models[arch], tmp_path / "server.log",
                      threads=2) as server:
        server.wait_healthy(timeout=120)
        assert server.health() == {"http_status": 200, "status": "ok"}
        first = server.complete(PROMPT, n_predict=24, ignore_eos=True)
        second = server.complete(PROMPT, n_predict=24, ignore_eos=True)
    assert len(first["tokens"]) == 24
    assert first["tokens"] == second["tokens"]
    assert first["content"] == second["content"]
    log = (tmp_path / "server.log").read_text()
    assert "listening on http://127.0.0.1:" in log


def test_patched_and_stock_agree(tmp_path: Path, fixture_models, patched_build, stock_build) -> None:
    """Greedy tokens of the patched build equal stock's (the exactness promise, at its simplest)."""
    outputs = []
    for result in (patched_build, stock_build):
        with start_server(result.binary("llama-server"), fixture_models["qwen3moe"], tmp_path / "s.log",
                          threads=2) as server:
            server.wait_healthy()
            outputs.append(server.complete(PROMPT, n_predict=32, ignore_eos=True)["tokens"])
    assert outputs[0] == outputs[1]


def test_second_build_is_a_no_op(patched_build) -> None:
    from moeplug.native import resolve_options

    started = time.monotonic()
    again = build(resolve_options("cpu", stock=False, jobs=0, cuda_arch=None))
    assert again.built is False
    assert again.build_id == patched_build.build_id
    assert time.monotonic() - started < 10


def test_build_ids_separate_stock_and_patched(patched_build, stock_build) -> None:
    assert patched_build.build_id != stock_build.build_id
    assert "-stock-" in stock_build.build_id and "-moeplug-" in patched_build.build_id
    assert stock_build.manifest["stock"] is True and stock_build.manifest["patches"] == []
    assert patched_build.manifest["llama_cpp_tag"] == "b11434"


def test_sanitized_build_is_its_own_and_instrumented(patched_build, sanitized_build) -> None:
    """--sanitize: its own id (suffix -asan), the normal build's id untouched, only the fuzz's
    programs, and every program and library of ours linked to the ASan and UBSan runtimes."""
    import subprocess

    from moeplug.native.build import SANITIZE_CMAKE_FLAGS, BuildOptions, cmake_args

    assert sanitized_build.build_id.endswith("-asan") and not patched_build.build_id.endswith("-asan")
    assert sanitized_build.build_id.rsplit("-", 2)[0] == patched_build.build_id.rsplit("-", 1)[0]
    assert "sanitize" not in BuildOptions(backend="cpu").identity()  # the normal id hashes what it always did
    normal = cmake_args(BuildOptions(backend="cpu"), Path("/t"), Path("/b"))
    assert not set(SANITIZE_CMAKE_FLAGS) & set(normal)
    assert sanitized_build.manifest["sanitize"] is True and not patched_build.manifest.get("sanitize")
    assert sanitized_build.manifest["targets"] == ["llama-server", "llama-moe-profile"]
    libs = [p for p in sanitized_build.bin_dir.iterdir() if p.name in ("llama-server", "llama-moe-profile")
            or p.name.startswith(("libllama.so", "libggml"))]
    for path in (p for p in libs if not p.is_symlink()):
        needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        assert "libasan.so" in needed and "libubsan.so" in needed, path
    r = run_cli("native", "build", "--cuda", "--sanitize")
    assert r.returncode == 1 and r.stderr.strip() == "moeplug: error: --sanitize: sanitized builds are CPU builds " \
                                                     "(drop --cuda)", r.stderr
    assert {b["build_id"]: b["current"] for b in json.loads(run_cli("native", "status", "--json").stdout)["builds"]
            }[sanitized_build.build_id] is True  # prune keeps it


def test_status_lists_builds_with_features(patched_build, stock_build) -> None:
    r = run_cli("native", "status", "--json")
    assert r.returncode == 0, r.stderr
    builds = {b["build_id"]: b for b in json.loads(r.stdout)["builds"]}
    for result in (patched_build, stock_build):
        doc = builds[result.build_id]
        assert doc["usable"] is True and doc["backend"] == "cpu"
        assert doc["features"]["cpu_moe"] is True and doc["features"]["n_cpu_moe"] is True
    r = run_cli("native", "status", "--binary", str(stock_build.binary("llama-server")), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["features"]["fit"] is True
    r = run_cli("native", "status", "--binary", "/bin/true")
    assert r.returncode == 1 and "not a llama.cpp server" in r.stderr


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patched_build) -> Path:
    """A fresh XDG cache holding a copy of the real (already downloaded) sdist."""
    spec = load_spec()
    real = sdist_path(spec.lock)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    copy = sdist_path(spec.lock)
    copy.parent.mkdir(parents=True)
    shutil.copy2(real, copy)
    return tmp_path / "cache"


def test_sdist_hash_mismatch_fails_and_extracts_nothing(private_cache: Path, tmp_path: Path) -> None:
    spec = load_spec()
    copy = sdist_path(spec.lock)
    with open(copy, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(BuildError, match="sha256 mismatch.*nothing was extracted"):
        prepare_tree(spec, stock=True, tree_id="t", log=tmp_path / "log")
    assert not copy.exists()  # the bad file is gone, so the next build downloads again
    src_dir = private_cache / "moeplug" / "src"
    assert not src_dir.exists() or not any(src_dir.iterdir())  # no tree, not even a temporary one


def test_lock_with_other_hash_fails(private_cache: Path, tmp_path: Path) -> None:
    spec = load_spec()
    bad = NativeSpec(lock=replace(spec.lock, sha256="0" * 64), patches=(), overlay_dir=spec.overlay_dir)
    with pytest.raises(BuildError, match="expected 0000"):
        prepare_tree(bad, stock=True, tree_id="t", log=tmp_path / "log")


BAD_PATCH = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: moeplug <moeplug@localhost>
Subject: [PATCH] touch a line that is not there

---
 CMakeLists.txt | 2 +-
 1 file changed, 1 insertion(+), 1 deletion(-)

diff --git a/CMakeLists.txt b/CMakeLists.txt
--- a/CMakeLists.txt
+++ b/CMakeLists.txt
@@ -1,3 +1,3 @@
-this line is not in llama.cpp
+neither is this one
 nor this context
 nor this
"""

GOOD_PATCH = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: moeplug <moeplug@localhost>
Subject: [PATCH] add a marker file

---
 MOEPLUG-MARKER | 1 +
 1 file changed, 1 insertion(+)
 create mode 100644 MOEPLUG-MARKER

diff --git a/MOEPLUG-MARKER b/MOEPLUG-MARKER
new file mode 100644
--- /dev/null
+++ b/MOEPLUG-MARKER
@@ -0,0 +1 @@
+patched by moeplug
"""


def test_patch_series_applies_in_order_or_fails_by_name(private_cache: Path, tmp_path: Path) -> None:
    spec = load_spec()
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-add-marker.patch").write_text(GOOD_PATCH)
    overlay = tmp_path / "overlay"
    (overlay / "tools" / "moeplug-hello").mkdir(parents=True)
    (overlay / "tools" / "moeplug-hello" / "README.md").write_text("ours\n")
    good = NativeSpec(lock=spec.lock, patches=(patches / "0001-add-marker.patch",), overlay_dir=overlay)
    tree = prepare_tree(good, stock=False, tree_id="good", log=tmp_path / "log")
    assert (tree / "MOEPLUG-MARKER").read_text() == "patched by moeplug\n"
    assert (tree / "tools" / "moeplug-hello" / "README.md").read_text() == "ours\n"

    (patches / "0002-broken.patch").write_text(BAD_PATCH)
    broken = NativeSpec(lock=spec.lock, patches=tuple(sorted(patches.glob("*.patch"))), overlay_dir=overlay)
    with pytest.raises(BuildError, match=r"patch 0002-broken.patch does not apply: .*CMakeLists.txt"):
        prepare_tree(broken, stock=False, tree_id="broken", log=tmp_path / "log")
    assert not (private_cache / "moeplug" / "src" / "broken").exists()
    assert "while searching for" in (tmp_path / "log").read_text()  # the failing hunk is logged
    # a different series is a different build
    assert build_id(good, _cpu()) != build_id(broken, _cpu()) != build_id(spec, _cpu())


def _cpu():
    from moeplug.native.build import BuildOptions

    return BuildOptions(backend="cpu")


def test_worktree_roundtrip(private_cache: Path, tmp_path: Path) -> None:
    """worktree -> commit a change -> export gives a patch series that builds the same tree."""
    import subprocess

    from moeplug.native.devloop import export_patches, make_worktree

    root = tmp_path / "native"
    shutil.copytree(load_spec().overlay_dir.parent, root, ignore=shutil.ignore_patterns("bench"))
    spec = load_spec(root)
    tree = make_worktree(tmp_path / "wt", spec)
    (tree / "README.md").write_text((tree / "README.md").read_text() + "\nmoeplug was here\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "commit", "-qam", "README: say hello"], cwd=tree, env=env, check=True)
    patches = export_patches(tree, spec, root)
    assert [p.name for p in patches] == [f"{len(spec.patches) + 1:04d}-README-say-hello.patch"] or \
        patches[-1].name.endswith("README-say-hello.patch")
    rebuilt = prepare_tree(load_spec(root), stock=False, tree_id="rt", log=tmp_path / "log")
    assert (rebuilt / "README.md").read_text().endswith("moeplug was here\n")


def test_prune_removes_only_stale_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patched_build) -> None:
    """A build whose id this checkout would not produce (another patch series) is stale."""
    from moeplug.native.build import installed_builds, is_current, prune, tree_id

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    builds = tmp_path / "data" / "moeplug" / "builds"
    shutil.copytree(patched_build.path, builds / patched_build.build_id, symlinks=True)
    old_id = patched_build.build_id.rsplit("-", 1)[0] + "-000000000000"
    shutil.copytree(patched_build.path, builds / old_id, symlinks=True)
    manifest = json.loads((builds / old_id / "build.json").read_text())
    manifest.update(build_id=old_id, patches=["0001-an-older-patch.patch"])
    (builds / old_id / "build.json").write_text(json.dumps(manifest))
    src = tmp_path / "cache" / "moeplug" / "src"
    for name in (tree_id(load_spec(), True), tree_id(load_spec(), False), "b11434-0123456789abcdef"):
        (src / name).mkdir(parents=True)

    state = {b.build_id: is_current(b) for b in installed_builds()}
    assert state == {patched_build.build_id: True, old_id: False}
    assert set(prune(dry_run=True)) == {builds / old_id, src / "b11434-0123456789abcdef"}
    assert (builds / old_id).exists()  # a dry run removes nothing
    r = run_cli("native", "prune", "--json")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)["removed"]) == {str(builds / old_id), str(src / "b11434-0123456789abcdef")}
    assert [b.build_id for b in installed_builds()] == [patched_build.build_id]
    assert sorted(p.name for p in src.iterdir()) == sorted([tree_id(load_spec(), True), tree_id(load_spec(), False)])


def test_build_number_and_commit_come_from_the_release_source() -> None:
    """A build from the release sdist (no .git for llama.cpp's build-info.cmake to ask) is told its
    number and commit, so llama-server's system_fingerprint names it, not "b0-unknown": the tag's
    number, the sdist's hash and, patched, the patch series' hash. They are part of the build id."""
    from moeplug.native.build import BuildOptions, build_info, cmake_args

    spec = load_spec()
    stock, patched = build_info(spec, stock=True), build_info(spec, stock=False)
    assert stock[0] == patched[0] == int(spec.lock.tag.removeprefix("b")) == 11434
    assert stock[1] == f"sdist.{spec.lock.sha256[:8]}" and patched[1] == f"{stock[1]}-moeplug.{spec.digest(False)[:8]}"
    args = cmake_args(BuildOptions(backend="cpu"), Path("/t"), Path("/b"), patched)
    assert "-DLLAMA_BUILD_NUMBER=11434" in args and f"-DLLAMA_BUILD_COMMIT={patched[1]}" in args
    plain = cmake_args(BuildOptions(backend="cpu"), Path("/t"), Path("/b"))
    assert not any(a.startswith(("-DLLAMA_BUILD_NUMBER", "-DLLAMA_BUILD_COMMIT")) for a in plain)
