"""`moeplug calibrate`: the real patched CPU build's llama-bench on the demo model, written into a
temporary home; the file it writes is reused, read back, and refused when damaged; the fingerprint
follows the build. With --rpc, the hop to real ggml-rpc-servers of the build on loopback."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from helpers import one_line_error, run_cli, run_cli_process, xdg_homes

from moeplug.machine.fingerprint import fingerprint_of, machine_fingerprint, machine_identity
from moeplug.machine.gpu import gpus
from moeplug.operations.calibrate import (Calibration, calibration_path, costs_for, read_calibration,
                                          stored_calibration)

KEYS = ("fingerprint", "cpu_expert_bytes_per_s", "round_trip_s", "h2d_bytes_per_s", "measured_at", "path")


@pytest.fixture(scope="module")
def calibrated(patched_build, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, Any]]:
    """`moeplug calibrate --json` once, in a child process with its own home: (its env, its JSON)."""
    env = xdg_homes(tmp_path_factory.mktemp("calibrate"))
    r = run_cli_process("calibrate", "--json", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return env, json.loads(r.stdout)


@pytest.fixture
def home(calibrated, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This process in the calibrated home (for run_cli and the library)."""
    env, doc = calibrated
    for var in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(var, env[var])
    return doc


def test_calibrate_json_measures_the_cpu_and_writes_the_file(calibrated, patched_build) -> None:
    env, doc = calibrated
    assert all(k in doc for k in KEYS), sorted(doc)
    assert 1e7 <= doc["cpu_expert_bytes_per_s"] <= 1e12, doc["cpu_expert_bytes_per_s"]
    assert doc["build_id"] == patched_build.build_id and doc["threads"] >= 1 and doc["reused"] is False
    assert doc["measured_at"].endswith("Z") and len(doc["fingerprint"]) == 12
    assert any("demo model" in n for n in doc["notes"])
    assert doc["runs"] and doc["runs"][0]["ms_per_token"] > 0
    if not gpus():  # this machine: the CPU side only, and it says so
        assert doc["round_trip_s"] is None and doc["h2d_bytes_per_s"] is None
        assert any("no GPU: the bus is not measured" in n for n in doc["notes"])
    path = Path(doc["path"])
    assert path.is_relative_to(env["XDG_DATA_HOME"]) and path.name == f"{doc['fingerprint']}.json"
    written = json.loads(path.read_text())
    assert written == {k: v for k, v in doc.items() if k not in ("path", "reused")}


def test_a_second_run_reuses_the_file_unless_forced(home: dict[str, Any], patched_build) -> None:
    r = run_cli("calibrate", "--json")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["reused"] is True and again["measured_at"] == home["measured_at"]
    assert again["cpu_expert_bytes_per_s"] == home["cpu_expert_bytes_per_s"]
    assert "this machine is calibrated" in r.stderr
    stored = stored_calibration(patched_build)
    assert stored is not None and stored.fingerprint == home["fingerprint"]

    r = run_cli("calibrate", "--force", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "written:" in r.stdout and "at 1 threads" in r.stdout
    assert "hop to a remote device" not in r.stdout  # no line where no hop was measured
    # the table and the notes fit 80 columns (the file's path is as long as it is)
    assert max(len(line) for line in r.stdout.splitlines() if not line.startswith("written: ")) <= 80
    assert read_calibration(Path(home["path"])).threads == 1


def test_a_hand_written_file_reads(tmp_path: Path) -> None:
    path = tmp_path / "pcie3.json"
    path.write_text(json.dumps({"cpu_expert_bytes_per_s": 40e9, "h2d_bytes_per_s": 12e9}))
    cal = read_calibration(path)
    assert cal.cpu_expert_bytes_per_s == 40e9 and cal.h2d_bytes_per_s == 12e9
    assert cal.round_trip_s is None and cal.prompt_upload_bytes_per_s is None and cal.measured_at is None
    assert cal.fingerprint == "" and cal.notes == [] and cal.machine == {}
    path.write_text(json.dumps({"cpu_expert_bytes_per_s": 25000000000, "round_trip_s": 0.0001, "threads": 8}))
    assert read_calibration(path).threads == 8 and read_calibration(path).round_trip_s == 1e-4
    # a measured record round-trips
    measured = Calibration("abc", 5e9, round_trip_s=6e-5, h2d_bytes_per_s=2.5e10, measured_at="2026-12-05T00:00:00Z",
                           threads=4, build_id="b", machine={"gpus": []}, notes=["n"], rpc_hop_s=4e-4,
                           rpc=["10.0.0.2:50052"])
    path.write_text(json.dumps(measured.to_json()))
    assert read_calibration(path) == measured


@pytest.mark.parametrize("text, words", [
    ("{not json", ["not JSON"]),
    ('["a list"]', ["expected a JSON object"]),
    ('{"h2d_bytes_per_s": 6e9}', ["'cpu_expert_bytes_per_s' is missing"]),
    ('{"cpu_expert_bytes_per_s": "fast"}', ["'cpu_expert_bytes_per_s'", "positive number"]),
    ('{"cpu_expert_bytes_per_s": true}', ["'cpu_expert_bytes_per_s'"]),
    ('{"cpu_expert_bytes_per_s": 0}', ["'cpu_expert_bytes_per_s'", "positive"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "h2d_bytes_per_s": -6e9}', ["'h2d_bytes_per_s'", "positive"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "threads": 2.5}', ["'threads'"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "notes": "one"}', ["'notes'"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "h2d_byte_per_s": 6e9}', ["unknown key 'h2d_byte_per_s'"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "rpc": "10.0.0.2:50052"}', ["'rpc'", "HOST:PORT"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "rpc": ["10.0.0.2:0"]}', ["'rpc'", "HOST:PORT"]),
    ('{"cpu_expert_bytes_per_s": 4e10, "rpc_hop_s": -1e-3}', ["'rpc_hop_s'", "0 or more"]),
])
def test_a_bad_file_is_one_line(home: dict[str, Any], text: str, words: list[str]) -> None:
    """This machine's file damaged: `moeplug calibrate` refuses it in one line naming the file and the
    key, and --force measures again over it."""
    path = Path(home["path"])
    path.write_text(text)
    try:
        line = one_line_error(run_cli("calibrate"), 1, str(path), *words)
        assert "--force" in line
        with pytest.raises(Exception) as err:
            read_calibration(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    finally:
        path.write_text(json.dumps({k: v for k, v in home.items() if k not in ("path", "reused")}))


def test_force_measures_over_a_damaged_file(home: dict[str, Any]) -> None:
    path = Path(home["path"])
    path.write_text("{")
    r = run_cli("calibrate", "--force", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reused"] is False and read_calibration(path).cpu_expert_bytes_per_s > 0


def test_usage_errors(home: dict[str, Any]) -> None:
    one_line_error(run_cli("calibrate", "--threads", "0"), 2, "out of range")
    one_line_error(run_cli("calibrate", "/nonexistent/model.gguf"), 1, "/nonexistent/model.gguf")


def test_the_fingerprint_follows_the_build_and_the_machine(home: dict[str, Any], patched_build) -> None:
    fp, identity = machine_fingerprint(patched_build.build_id)
    assert fp == home["fingerprint"] == machine_fingerprint(patched_build.build_id)[0]
    assert identity == home["machine"] and set(identity) == {"gpus", "cpu", "ram_gib"}
    assert machine_fingerprint(patched_build.build_id + "-other")[0] != fp
    assert calibration_path(fp) == Path(home["path"])
    gpu = {"name": "NVIDIA GeForce RTX 4070", "memory_bytes": 12 << 30, "pcie_gen": 4, "pcie_width": 16,
           "driver": "550.54"}
    here = machine_identity()
    with_gpu = fingerprint_of({**here, "gpus": [gpu]}, "b")
    assert with_gpu != fingerprint_of(here, "b")
    assert fingerprint_of({**here, "gpus": [{**gpu, "driver": "555.42"}]}, "b") != with_gpu  # a new driver
    assert fingerprint_of({**here, "gpus": [{**gpu, "pcie_width": 4}]}, "b") != with_gpu  # a narrower slot


# ---------------------------------------------------------------------------------------------
# --rpc: the hop to a remote device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_calibrate_rpc_measures_the_hop(rpc_hosts, patched_build, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rpc-servers of the build on loopback (conftest.rpc_hosts): the hop measured to the first."""
    (rpc_endpoint, second), _ = rpc_hosts
    env = xdg_homes(tmp_path)
    r = run_cli_process("calibrate", "--rpc", f"{rpc_endpoint},{second}", "--json", env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert 0 < doc["rpc_hop_s"] < 0.05, doc["rpc_hop_s"]  # loopback: well under a LAN's millisecond or so
    assert doc["rpc"] == [rpc_endpoint] and doc["cpu_expert_bytes_per_s"] > 0
    hop = [n for n in doc["notes"] if n.startswith("remote hop:")]
    assert len(hop) == 1 and "round trip a token through llama.cpp's RPC path" in hop[0], doc["notes"]
    assert "negligible" in hop[0] and f"first host only, not {second}" in hop[0]
    remote = [run for run in doc["runs"] if "-rpc" in run["args"]]
    assert len(remote) == 1 and rpc_endpoint in remote[0]["args"] and remote[0]["ms_per_token"] > 0
    assert json.loads(Path(doc["path"]).read_text())["rpc_hop_s"] == doc["rpc_hop_s"]
    for var in ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(var, env[var])
    assert costs_for(patched_build).rpc_hop_s == doc["rpc_hop_s"]  # what the planner plans with
    # the table shows it; the same first host again reuses the file, another measures again
    r = run_cli("calibrate", "--rpc", rpc_endpoint)
    assert r.returncode == 0 and "this machine is calibrated" in r.stderr, r.stderr
    assert f"us to {rpc_endpoint}" in r.stdout and "hop to a remote device" in r.stdout, r.stdout
    again = json.loads(run_cli("calibrate", "--rpc", second, "--json").stdout)
    assert again["reused"] is False and again["rpc"] == [second] and again["rpc_hop_s"] > 0
    # without --rpc: the stored file, hop and all
    assert json.loads(run_cli("calibrate", "--json").stdout)["rpc"] == [second]


def test_calibrate_rpc_to_a_host_that_does_not_answer_writes_nothing(patched_build, tmp_path: Path) -> None:
    env = xdg_homes(tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    r = run_cli_process("calibrate", "--rpc", endpoint, env=env, timeout=120)
    one_line_error(r, 1, f"--rpc {endpoint}", "does not answer")
    assert r.stdout == ""
    assert not (Path(env["XDG_DATA_HOME"]) / "moeplug" / "calibration").exists()
    assert not (Path(env["XDG_DATA_HOME"]) / "moeplug" / "models").exists()  # not even the demo model made


# ---------------------------------------------------------------------------------------------
# which model it measures with, and a demo-measured file replaced


def test_calibrate_takes_the_installed_model_and_replaces_a_demo_measured_file(patched_build, tmp_path: Path) -> None:
    """In a home calibrated on the demo model (nothing installed yet), a real model installed: `moeplug
    calibrate` with no model measures with it, says so, and replaces the demo's file without --force;
    the file records the model and how each figure was measured; run again, it is reused."""
    env = xdg_homes(tmp_path / "home")
    r = run_cli_process("calibrate", "--json", env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert Path(first["model"]).name.startswith("demo-") and first["methods"]["cpu_expert_bytes_per_s"] == "cpu-run"
    model = tmp_path / "small-moe.gguf"
    made = run_cli_process("dev", "make-model", "--out", str(model), "--layers", "3", "--experts", "8", "--used", "2",
                           "--embd", "256", "--expert-ff", "256", env=env, timeout=120)
    assert made.returncode == 0, made.stderr
    r = run_cli_process("install", str(model), "--ctx", "512", "--no-serve", "--profile-tokens", "8", env=env,
                        timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli_process("calibrate", "--json", env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["reused"] is False and doc["model"] == str(model) and doc["path"] == first["path"]
    assert "measuring with small-moe" in r.stderr and "measured on the demo model" in r.stderr
    assert not any("demo model" in n for n in doc["notes"])
    assert doc["methods"]["cpu_expert_bytes_per_s"] == ("cpu-run" if not gpus() else "gpu-split")
    written = json.loads(Path(doc["path"]).read_text())
    assert written["model"] == str(model) and written["measured_at"] == doc["measured_at"]
    again = run_cli_process("calibrate", "--json", env=env, timeout=180)
    assert again.returncode == 0 and json.loads(again.stdout)["reused"] is True, again.stderr
    # the table says how each figure was measured and with which model
    shown = run_cli_process("calibrate", env=env, timeout=180).stdout
    assert "(cpu-run)" in shown or "(gpu-split)" in shown
    assert "small-moe.gguf" in shown


def test_split_costs_take_the_rate_and_the_round_trip_apart() -> None:
    """calibrate's three GPU runs turned into figures (operations.calibrate._split_costs) on a real model
    file's tensor sizes: times made from a known rate and round trip give them back; where the down
    projections alone do not resolve a rate, the rate comes from the whole layers at the fitted round
    trip; where moving layers saved nothing, nothing is claimed."""
    from moeplug.model.demo import ensure_demo_model
    from moeplug.model.inspect import inspect_model
    from moeplug.operations.calibrate import METHOD_GPU_LAYERS, METHOD_GPU_SPLIT, _down_bytes_per_expert, _split_costs

    info = inspect_model(ensure_demo_model())
    moved = [layer.block for layer in info.layers][-2:]
    by_block = {layer.block: layer for layer in info.layers}
    full = sum(info.n_expert_used * by_block[b].bytes_per_expert for b in moved)
    down = sum(info.n_expert_used * _down_bytes_per_expert(by_block[b]) for b in moved)
    assert 0 < down < full
    rate, trip, rest = 5e9, 80e-6, 0.010
    got = _split_costs(info, moved, rest + 2 * trip + full / rate, rest, rest + 2 * trip + down / rate)
    assert got.method == METHOD_GPU_SPLIT
    assert got.cpu_rate == pytest.approx(rate) and got.round_trip == pytest.approx(trip)
    # the split run no faster than every layer in RAM: the rate from the whole layers, the fitted round trip
    whole = rest + 2 * trip + full / rate
    got = _split_costs(info, moved, whole, rest, whole, fallback_round_trip=trip)
    assert got.method == METHOD_GPU_LAYERS and got.round_trip is None and got.cpu_rate == pytest.approx(rate)
    got = _split_costs(info, moved, rest, rest, rest)
    assert got.cpu_rate is None and got.round_trip is None and "not resolved" in got.note
