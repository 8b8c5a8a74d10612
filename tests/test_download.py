"""Downloads from the Hugging Face Hub (moeplug.model.download) through huggingface_hub over real HTTP,
from a stand-in Hub on 127.0.0.1 (tests/fake_hub.py): `moeplug install user/repo:QUANT` fetches the
file the reference names into the shared cache, checks it against the SHA-256 the Hub lists, and
finds it there offline afterwards; a split model comes whole, and a dropped connection resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHub, Repo
from helpers import fixture_spec, run_cli_process, xdg_homes

from moeplug.model.synth import make_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(fixture_spec("qwen3moe"), tmp_path_factory.mktemp("m") / "tiny.gguf")[0]


def hub_env(base: dict[str, str], hub: FakeHub, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(("HF_", "HUGGINGFACE_", "LLAMA_CACHE"))}
    return env | {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1",
                  "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


def snapshot(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT


@pytest.mark.native
def test_install_downloads_the_quant_it_names(patched_build, tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    with FakeHub() as hub:
        hub.repos["org/Tiny-GGUF"] = Repo({"Tiny-Q8_0.gguf": data, "Tiny-Q4_K_M.gguf": b"GGUF not this one",
                                           "README.md": b"# Tiny\n"})
        env = hub_env(xdg_homes(tmp_path), hub, tmp_path / "hub")
        r = run_cli_process("install", "org/Tiny-GGUF:Q8_0", "--no-serve", "--ctx", "512", "--json", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        # the file the reference names, once, whole; nothing else of the repo
        assert hub.gets("Tiny-Q8_0.gguf") == [None]
        assert hub.gets("Tiny-Q4_K_M.gguf") == [] and hub.gets("README.md") == []
    path = snapshot(tmp_path / "hub", "org/Tiny-GGUF") / "Tiny-Q8_0.gguf"
    assert path.read_bytes() == data
    assert json.loads(r.stdout)["model"] == str(path)  # installed from the shared cache, not copied
    assert "downloading 1 file(s)" in r.stderr and "checking org/Tiny-GGUF/Tiny-Q8_0.gguf (SHA-256)" in r.stderr
    # afterwards the cache serves it offline, as llama.cpp's -hf would find it
    env["HF_HUB_OFFLINE"] = "1"
    again = run_cli_process("resolve", "org/Tiny-GGUF:Q8_0", "--json", env=env)
    assert again.returncode == 0, again.stderr
    doc = json.loads(again.stdout)
    assert doc["path"] == str(path) and doc["source"] == "hf-cache" and doc["revision"] == COMMIT


@pytest.mark.native
def test_a_file_unlike_the_hubs_hash_is_deleted(patched_build, tiny_gguf: Path, tmp_path: Path) -> None:
    with FakeHub() as hub:
        hub.repos["org/Tiny-GGUF"] = Repo({"Tiny-Q8_0.gguf": tiny_gguf.read_bytes()}, wrong_sha={"Tiny-Q8_0.gguf"})
        env = hub_env(xdg_homes(tmp_path), hub, tmp_path / "hub")
        r = run_cli_process("install", "org/Tiny-GGUF:Q8_0", "--no-serve", "--ctx", "512", env=env)
        unknown = run_cli_process("install", "org/Nothing-GGUF:Q8_0", "--no-serve", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert "org/Tiny-GGUF/Tiny-Q8_0.gguf: SHA-256" in line and "the file was deleted" in line
    repo_dir = tmp_path / "hub" / "models--org--Tiny-GGUF"
    assert not (snapshot(tmp_path / "hub", "org/Tiny-GGUF") / "Tiny-Q8_0.gguf").exists()
    assert not [b for b in (repo_dir / "blobs").iterdir() if not b.name.endswith(".incomplete")]
    assert not (Path(env["XDG_DATA_HOME"]) / "moeplug" / "installed").exists() or \
        not list((Path(env["XDG_DATA_HOME"]) / "moeplug" / "installed").glob("*.json"))
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert "org/Nothing-GGUF: the Hugging Face Hub refused" in unknown.stderr.strip().splitlines()[-1]


def test_a_split_model_comes_whole_and_a_cut_download_resumes(tmp_path: Path) -> None:
    shards = make_model(fixture_spec("hy_v3"), tmp_path / "gen" / "Big-Q4_K_M.gguf", shards=3)
    # huggingface_hub writes what it received in chunks of 10 MiB (constants.DOWNLOAD_CHUNK_SIZE) and resumes
    # from the last one written: the second shard is made larger than a chunk, and cut just past one
    chunk = 10 << 20
    shards[1].write_bytes(shards[1].read_bytes() + bytes(range(256)) * ((chunk + (1 << 20)) // 256))
    files = {f"Q4_K_M/{p.name}": p.read_bytes() for p in shards}
    files["Big-Q8_0.gguf"] = b"GGUF"
    cut = f"Q4_K_M/{shards[1].name}"
    code = ("import json; from moeplug.model.refs import parse_ref; from moeplug.model.download import fetch_hf; "
            "r = fetch_hf(parse_ref('org/Big-GGUF:Q4_K_M')); print(json.dumps([str(p) for p in r.files]))")
    with FakeHub() as hub:
        hub.repos["org/Big-GGUF"] = Repo(files)
        hub.cut_after[cut] = chunk + 1000  # the connection drops a little past the second shard's first chunk
        env = hub_env(dict(os.environ), hub, tmp_path / "hub")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        ranges = hub.gets(cut)
    got = [Path(p) for p in json.loads(r.stdout)]
    assert [p.name for p in got] == [p.name for p in shards]
    assert [p.read_bytes() for p in got] == [s.read_bytes() for s in shards]
    # the second shard: the GET cut short, then the rest asked for from where it stopped
    assert ranges == [None, f"bytes={chunk}-"], ranges
    assert all(hub.gets(f"Q4_K_M/{p.name}") == [None] for p in (shards[0], shards[2]))
    assert hub.gets("Big-Q8_0.gguf") == []
