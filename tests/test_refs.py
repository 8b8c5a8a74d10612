"""Model references against real stores laid out on disk: the HF hub cache and Ollama's store."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import fixture_spec
from moeplug.core.errors import MoeplugError
from moeplug.model.inspect import inspect_model
from moeplug.model.refs import load_recipes, parse_ref, resolve_ref
from moeplug.model.synth import make_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(fixture_spec("qwen3moe"), tmp_path_factory.mktemp("m") / "tiny.gguf")[0]


def add_to_hf_cache(cache: Path, repo: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """Lay out files the way huggingface_hub does: blobs by hash, snapshot symlinks, refs/main."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return repo_dir / "snapshots" / commit


def add_to_ollama(root: Path, name: str, tag: str, data: bytes, host_path: tuple[str, ...]) -> Path:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / digest.replace(":", "-")
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = root / "manifests" / Path(*host_path) / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": len(data)},
    ]}))
    return blob


@pytest.mark.parametrize("text, kind, repo, quant, filename", [
    ("unsloth/Qwen3-30B-A3B-GGUF", "hf", "unsloth/Qwen3-30B-A3B-GGUF", "Q4_K_M", None),
    ("unsloth/Qwen3-30B-A3B-GGUF:q8_0", "hf", "unsloth/Qwen3-30B-A3B-GGUF", "q8_0", None),
    ("org/repo/Q4_K_M/model-00001-of-00002.gguf", "hf", "org/repo", None, "Q4_K_M/model-00001-of-00002.gguf"),
    ("qwen3-30b-a3b", "hf", "unsloth/Qwen3-30B-A3B-GGUF", "Q4_K_M", None),
    ("MIXTRAL", "hf", "TheBloke/Mixtral-8x7B-Instruct-v0.1-GGUF", "Q4_K_M", None),
    ("demo", "demo", None, None, None),
    ("./model.gguf", "local", None, None, None),
    ("model.gguf", "local", None, None, None),
])
def test_parse(text: str, kind: str, repo: str | None, quant: str | None, filename: str | None) -> None:
    ref = parse_ref(text)
    assert (ref.kind, ref.repo, ref.quant, ref.filename) == (kind, repo, quant, filename)


@pytest.mark.parametrize("text, name, tag", [
    ("ollama:qwen3", "qwen3", "latest"),
    ("ollama:qwen3:30b-a3b", "qwen3", "30b-a3b"),
    ("ollama:user/model:q4", "user/model", "q4"),
    ("ollama:localhost:5000/ns/model", "localhost:5000/ns/model", "latest"),
])
def test_parse_ollama(text: str, name: str, tag: str) -> None:
    ref = parse_ref(text)
    assert (ref.kind, ref.ollama_name, ref.ollama_tag) == ("ollama", name, tag)


def test_unknown_reference() -> None:
    with pytest.raises(MoeplugError, match="unknown model reference 'what is this'"):
        parse_ref("what is this")


def test_recipes_cover_the_known_models() -> None:
    recipes = {r.name for r in load_recipes().values()}
    for name in ("qwen3-30b-a3b", "qwen3.6-35b-a3b", "gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air", "mixtral-8x7b",
                 "deepseek-v2-lite"):
        assert name in recipes
    assert load_recipes()["qwen3.5-35b-a3b"].name == "qwen3.6-35b-a3b"  # an alias


def test_hf_cache_quant_case_insensitive(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tiny_gguf.read_bytes()
    snap = add_to_hf_cache(tmp_path / "hub", "org/Tiny-GGUF", {
        "Tiny-Q4_K_M.gguf": data, "Tiny-Q8_0.gguf": data + b"x", "README.md": b"hi", "mmproj-Tiny-Q8_0.gguf": b"p"})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = resolve_ref("org/Tiny-GGUF:q8_0")
    assert r.path == snap / "Tiny-Q8_0.gguf" and r.revision == COMMIT and r.source == "hf-cache"
    assert resolve_ref("org/Tiny-GGUF").path == snap / "Tiny-Q4_K_M.gguf"  # the default quant
    assert inspect_model(resolve_ref("org/Tiny-GGUF/Tiny-Q4_K_M.gguf").path).arch == "qwen3moe"
    with pytest.raises(MoeplugError, match="no Q6_K GGUF"):
        resolve_ref("org/Tiny-GGUF:Q6_K")
    with pytest.raises(MoeplugError, match="org/Other is not in the Hugging Face cache"):
        resolve_ref("org/Other:Q4_K_M")


def test_hf_cache_split_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shards = make_model(fixture_spec("hy_v3"), tmp_path / "gen" / "Big-Q4_K_M.gguf", shards=3)
    files = {f"Q4_K_M/{p.name}": p.read_bytes() for p in shards}
    files["Big-Q8_0.gguf"] = b"GGUF"
    snap = add_to_hf_cache(tmp_path / "hub", "org/Big-GGUF", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = resolve_ref("org/Big-GGUF:Q4_K_M")
    assert [p.name for p in r.files] == [p.name for p in shards] and r.path == snap / "Q4_K_M" / shards[0].name
    assert inspect_model(r.path).shards == r.files
    # a shard named directly resolves to the whole set; an incomplete set is an error
    assert resolve_ref(f"org/Big-GGUF/Q4_K_M/{shards[1].name}").files == r.files
    (snap / "Q4_K_M" / shards[2].name).unlink()
    with pytest.raises(MoeplugError, match=f"incomplete: missing Q4_K_M/{shards[2].name}"):
        resolve_ref("org/Big-GGUF:Q4_K_M")


def test_hf_cache_ambiguous_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_to_hf_cache(tmp_path / "hub", "org/Two", {"A-Q4_K_M.gguf": b"a", "UD-Q4_K_M/B-Q4_K_M.gguf": b"b"})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(MoeplugError, match="Q4_K_M is ambiguous .*name the file"):
        resolve_ref("org/Two:Q4_K_M")


def test_hf_cache_location_follows_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moeplug.model.refs import hf_cache_dir

    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert hf_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_cache_dir() == tmp_path / "hub"


def test_ollama_store(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ollama"
    blob = add_to_ollama(root, "qwen3", "30b-a3b", tiny_gguf.read_bytes(), ("registry.ollama.ai", "library"))
    other = add_to_ollama(root, "tiny", "latest", b"GGUF-ish", ("registry.ollama.ai", "someone"))
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    r = resolve_ref("ollama:qwen3:30b-a3b")
    assert r.path == blob and r.source == "ollama"  # used in place, not copied
    assert inspect_model(r.path).n_expert == 8
    assert resolve_ref("ollama:someone/tiny").path == other
    with pytest.raises(MoeplugError, match="no Ollama manifest .*is the model pulled"):
        resolve_ref("ollama:qwen3:latest")
    blob.unlink()
    with pytest.raises(MoeplugError, match="is missing"):
        resolve_ref("ollama:qwen3:30b-a3b")


def test_cli_resolve(tmp_path: Path, tiny_gguf: Path) -> None:
    add_to_hf_cache(tmp_path / "hub", "unsloth/Qwen3-30B-A3B-GGUF",
                    {"Qwen3-30B-A3B-Q4_K_M.gguf": tiny_gguf.read_bytes()})
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "moeplug", "resolve", "qwen3-30b-a3b", "--json"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["recipe"] == "qwen3-30b-a3b" and doc["revision"] == COMMIT
    assert doc["path"].endswith("snapshots/" + COMMIT + "/Qwen3-30B-A3B-Q4_K_M.gguf")
    # offline with nothing cached: one clear line, non-zero
    env["HF_HUB_CACHE"] = str(tmp_path / "empty")
    r = subprocess.run([sys.executable, "-m", "moeplug", "resolve", "gpt-oss-20b"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "not in the Hugging Face cache" in r.stderr
    r = subprocess.run([sys.executable, "-m", "moeplug", "recipes", "--json"], capture_output=True, text=True)
    assert r.returncode == 0 and len(json.loads(r.stdout)) >= 7
