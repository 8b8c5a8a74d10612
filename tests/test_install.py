"""`moeplug install demo` -> serve -> a completion -> stop, end to end, and the errors around it.

Each test gets its own XDG data/state/config homes (nothing of the user's is touched); the
native builds, slow to make, are shared through a link to the real builds folder.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import requests
from helpers import moeplug, one_line_error

from moeplug.model.download import check_disk
from moeplug.core.errors import MoeplugError

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("patched_build")]


def complete(url: str) -> list[int]:
    r = requests.post(f"{url}/completion", json={"prompt": "def main():", "n_predict": 12, "temperature": 0,
                                                  "return_tokens": True, "cache_prompt": False}, timeout=120)
    r.raise_for_status()
    return list(r.json()["tokens"])


def test_install_demo_serve_complete_stop(home: dict[str, str]) -> None:
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    srv = doc["server"]
    try:
        assert srv["cache"]["engaged"] and doc["plan"]["slots_per_layer"] == [8] * 4
        assert srv["cache"]["layers"] == 4 and srv["cache"]["slots"] == srv["cache"]["slots_min"] == 8
        assert srv["cache"]["slots_total"] == 32 and srv["cache"]["whole_layers"] == 0
        first = complete(srv["url"])
        assert len(first) == 12

        status = json.loads(moeplug(home, "status", "--json").stdout)["servers"]
        assert [(s["name"], s["alive"], s["healthy"]) for s in status] == [("demo", True, True)]
        # counted by default (--metrics): the request above, not the start-up check's full-context one
        assert status[0]["cache_counters"]["selections"] > 0 and status[0]["metrics"]["decode_tokens"] == 12
        assert "--moe-cache-record" in status[0]["args"]  # recording too, for 'moeplug reprofile'
        assert "of " in moeplug(home, "status").stdout.splitlines()[2]  # "measured hit rate: P% of N", not "-"
        # NVML's per-process figure: a CPU build's server holds nothing on any GPU
        assert status[0]["vram_bytes"] is None and status[0]["vram_budget_bytes"] is None  # a CPU plan
        listed = json.loads(moeplug(home, "list", "--json").stdout)["models"]
        assert [m["name"] for m in listed] == ["demo"] and Path(listed[0]["profile"]).exists()
    finally:
        assert moeplug(home, "stop", "demo").returncode == 0
    assert json.loads(moeplug(home, "status", "--json").stdout)["servers"] == []
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{srv['url']}/health", timeout=2)

    # serve again from the installed record: same profile, same plan, same tokens; with --metrics,
    # status shows the measured hit rate from llama-server's counters
    r = moeplug(home, "serve", "demo", "--json", "--metrics")
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads(r.stdout)["server"]
    try:
        assert again["cache"]["engaged"]
        assert complete(again["url"]) == first
        counters = json.loads(moeplug(home, "status", "--json").stdout)["servers"][0]["cache_counters"]
        assert counters["selections"] > 0 and counters["hits"] + counters["cpu_experts"] == counters["selections"]
        assert 0 < counters["hit_rate"] <= 1 and sorted(map(int, counters["layers"])) == [0, 1, 2, 3]
        assert sum(v["hits"] for v in counters["layers"].values()) == counters["hits"]
        human = moeplug(home, "status").stdout
        assert "measured hit rate" in human and f"{counters['hit_rate']:.1%} of " in human
        assert "VRAM of budget" in human
        r2 = moeplug(home, "serve", "demo")
        assert r2.returncode == 1 and "already served" in r2.stderr
    finally:
        moeplug(home, "stop", "--all")


def test_status_shows_vram_against_the_budget() -> None:
    """`moeplug status` puts what NVML says a server holds beside its plan's budget, and says by how
    much it is over; "-" where no NVIDIA GPU lists the process."""
    from dataclasses import replace

    from moeplug.commands.install import status_text
    from moeplug.planner.record import Plan
    from moeplug.serving.monitor import ServerSnapshot, Snapshot
    from moeplug.serving.launch import ServerRecord
    from moeplug.core.sizes import MIB

    record = ServerRecord(name="m", model="/nowhere/m.gguf", pid=1, port=8080, log="/tmp/l", args=["llama-server"],
                          started=0.0, build_id="b")
    over = ServerSnapshot(record=record, alive=True, healthy=True, uptime_s=1.0,
                          plan=Plan.from_json({"vram_budget_bytes": 5796 * MIB}), vram_bytes=5896 * MIB)
    servers = [over, replace(over, vram_bytes=5672 * MIB), replace(over, vram_bytes=None), replace(over, plan=None)]
    lines = status_text(Snapshot(taken_at=0.0, servers=servers, gpus=[])).splitlines()
    assert "VRAM of budget" in lines[0]
    assert "5896 MiB of 5796 (100 over)" in lines[2] and "5672 MiB of 5796 " in lines[3] + " "
    assert "over" not in lines[3] and " - " in lines[4] and "5896 MiB " in lines[5] and " of " not in lines[5]
    assert over.to_json()["vram_bytes"] == 5896 * MIB and over.to_json()["vram_budget_bytes"] == 5796 * MIB


def test_status_and_serve_say_where_the_gpu_computes_misses() -> None:
    """A server whose log says the GPU computes a share of the misses (--moe-cache-stream): `moeplug
    status`, the dashboard's servers table and the serve/install output name the layers and the
    share; without it, none does."""
    from dataclasses import asdict, replace

    from moeplug.commands.install import served_text, status_text
    from moeplug.serving.monitor import ServerSnapshot, Snapshot
    from moeplug.serving.launch import ServerRecord, parse_cache_line

    line = ("moe-cache: 24 layers x 4-10 slots (188 in all, 0 whole layers), 2313.11 MiB uploaded to CUDA0 in 0.91 s, "
            "policy dynamic (half-life 32 tokens, 8 uploads per batch), prompt batches in one pass on 24 layers, "
            "24 layers stream 75% of their misses")
    cache = parse_cache_line(line)
    assert cache is not None and (cache.streamed_layers, cache.stream_percent) == (24, 75)
    record = ServerRecord(name="m", model="/nowhere/m.gguf", pid=1, port=8080, log="/tmp/l", args=["llama-server"],
                          started=0.0, build_id="b", cache=asdict(cache))
    plain = replace(record, cache=asdict(replace(cache, streamed_layers=0, stream_percent=0)))
    snap = ServerSnapshot(record=record, alive=True, healthy=True, uptime_s=1.0)
    lines = status_text(Snapshot(taken_at=0.0, servers=[snap, replace(snap, record=plain)], gpus=[])).splitlines()
    assert "24x4-10 on CUDA0, 24 layers stream 75% of their misses" in lines[2] and "stream" not in lines[3]
    assert "on CUDA0 in 0.91 s, 24 layers stream 75% of their misses" in served_text("m", record)
    assert "stream" not in served_text("m", plain)
    from moeplug.tui.widgets.servers import server_rows

    cells = {name: row for name, row in server_rows(Snapshot(taken_at=0.0, servers=[snap], gpus=[]), {})}
    assert cells["m"][7] == "24x4-10 on CUDA0, 24 layers stream 75% of their misses"


def test_cache_line_counts_the_layers_that_overlap() -> None:
    """The log names the layers whose CPU computes their misses while the GPU computes their slots
    (native overlay, llama-moeplug-cache.cpp); the parsed status keeps the count, 0 where the line has none."""
    from moeplug.serving.launch import parse_cache_line

    line = ("moe-cache: 48 layers x 21-128 slots (2286 in all, 2 whole layers), 5612.00 MiB uploaded to CUDA0 in 1.20 s, "
            "policy dynamic (half-life 32 tokens, 8 uploads per batch), prompt batches in one pass on 46 layers")
    assert parse_cache_line(line).overlapped_layers == 0
    cache = parse_cache_line(line + ", 46 layers compute slots and misses at once")
    assert cache is not None and cache.overlapped_layers == 46 and cache.whole_layers == 2 and cache.streamed_layers == 0


def test_cache_line_counts_the_layers_that_read_their_misses_in_place() -> None:
    """With LLAMA_MOE_CACHE_DIRECT=1 (native patch 0026) the log names the layers whose GPU computes their
    misses too, read from pinned RAM; the parsed status keeps the count and the one-line summary names it."""
    from dataclasses import asdict

    from moeplug.serving.launch import cache_summary, parse_cache_line

    line = ("moe-cache: 48 layers x 21-128 slots (2286 in all, 2 whole layers), 5612.00 MiB uploaded to CUDA0 in 1.20 s, "
            "policy dynamic (half-life 32 tokens, 8 uploads per batch), prompt batches in one pass on 46 layers")
    assert parse_cache_line(line).direct_layers == 0
    cache = parse_cache_line(line + ", 46 layers read their misses in place")
    assert cache is not None and cache.direct_layers == 46 and cache.overlapped_layers == 0
    assert cache_summary(asdict(cache)) == "48x21-128 on CUDA0, 46 layers read their misses in place"


def test_human_output_says_how_to_query(home: dict[str, str]) -> None:
    r = moeplug(home, "install", "demo", "--ctx", "1024")
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "expert cache: 4 layers x 8 slots" in r.stdout
        assert "curl http://127.0.0.1:" in r.stdout and "moeplug stop demo" in r.stdout
    finally:
        moeplug(home, "stop", "--all")


def test_unknown_model(home: dict[str, str]) -> None:
    one_line_error(moeplug(home, "install", "not a model!"), 1, "unknown model reference")
    one_line_error(moeplug(home, "install", "./missing.gguf"), 1, "no such file")


def test_dense_model_installs_nothing(home: dict[str, str], tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_uint32("qwen3.block_count", 1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(moeplug(home, "install", str(path)), 3, "dense model")
    assert not (Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed").exists()


def test_offline_with_nothing_cached(home: dict[str, str], tmp_path: Path) -> None:
    env = {**home, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hub")}
    one_line_error(moeplug(env, "install", "someone/Some-MoE-GGUF:Q4_K_M"), 1, "HF_HUB_OFFLINE is set")
    assert not (Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed").exists()


def test_too_little_disk(tmp_path: Path) -> None:
    with pytest.raises(MoeplugError, match="to download but .* free in"):
        check_disk("some/repo", 1 << 60, tmp_path)
    check_disk("some/repo", 1024, tmp_path)  # fits: no error


def test_port_in_use(home: dict[str, str]) -> None:
    assert moeplug(home, "install", "demo", "--ctx", "1024", "--no-serve").returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(moeplug(home, "serve", "demo", "--port", str(port)), 1, "already in use")
    assert json.loads(moeplug(home, "status", "--json").stdout)["servers"] == []


def test_serve_needs_its_build_and_an_install(home: dict[str, str]) -> None:
    one_line_error(moeplug(home, "serve", "demo"), 1, "is not installed")
    assert moeplug(home, "install", "demo", "--ctx", "1024", "--no-serve").returncode == 0
    record = Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json"
    doc = json.loads(record.read_text())
    doc["build_id"] = "b11434-cpu-moeplug-000000000000"
    record.write_text(json.dumps(doc))
    one_line_error(moeplug(home, "serve", "demo"), 1, "is gone")


def test_stop_unknown(home: dict[str, str]) -> None:
    r = moeplug(home, "stop", "nothing")
    assert r.returncode == 1 and "was not running" in r.stdout


def test_reinstall_keeps_the_stored_profile(home: dict[str, str]) -> None:
    """A second install finds the profile the first made and uses it (it once re-profiled every time)."""
    assert moeplug(home, "install", "demo", "--ctx", "1024", "--no-serve").returncode == 0
    profile = Path(json.loads(moeplug(home, "list", "--json").stdout)["models"][0]["profile"])
    before = profile.stat()
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--no-serve")
    assert r.returncode == 0 and "already made" in r.stderr, r.stderr
    after = profile.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
