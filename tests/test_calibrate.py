"""`moeplug calibrate`: the real patched CPU build's llama-bench on the demo model, written into a
temporary home; the file it writes is reused, read back, and refused when damaged; the fingerprint
follows the build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import one_line_error, run_cli, run_cli_process, xdg_homes

from moeplug.machine.fingerprint import fingerprint_of, machine_fingerprint, machine_identity
from moeplug.machine.gpu import gpus
from moeplug.operations.calibrate import Calibration, calibration_path, read_calibration, stored_calibration

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
                           threads=4, build_id="b", machine={"gpus": []}, notes=["n"])
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
