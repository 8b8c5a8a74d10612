"""`moeplug schedule`: the systemd user service and timer (checked by `systemd-analyze verify` where it
is installed: only that assertion is skipped without it), and the crontab line. The crontab goes
through the real `crontab` program when one is installed (the user's table is saved first and
put back after); without it, through the file MOEPLUG_CRONTAB_FILE names. Either way the
scheduled command itself is run, as the timer or cron would run it.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import moeplug, run_cli_process, xdg_homes

XDG = ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = xdg_homes(tmp_path, share_builds=False)
    e.pop("MOEPLUG_CRONTAB_FILE", None)
    return e


def log_lines(env: dict[str, str]) -> list[str]:
    path = Path(env["XDG_STATE_HOME"]) / "moeplug" / "reprofile.log"
    return path.read_text().splitlines() if path.exists() else []


def test_systemd_units_verify_and_run_the_reprofile(env: dict[str, str], tmp_path: Path) -> None:
    r = moeplug(env, "schedule", "install", "--user", "--every", "6h", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == "systemd" and doc["every_s"] == 6 * 3600
    folder = Path(env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    service, timer = folder / "moeplug-reprofile.service", folder / "moeplug-reprofile.timer"
    assert doc["files"] == [str(service), str(timer)]
    assert "OnUnitActiveSec=21600s" in timer.read_text() and "WantedBy=timers.target" in timer.read_text()
    assert "SuccessExitStatus=10" in service.read_text()

    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", str(service), str(timer)], capture_output=True, text=True)
        assert v.returncode == 0, v.stderr
        broken = tmp_path / "broken" / "moeplug-reprofile.service"  # the verifier does refuse a bad unit
        broken.parent.mkdir()
        broken.write_text(service.read_text().replace("ExecStart=/", "ExecStart=relative/"))
        shutil.copy(timer, broken.parent)
        v = subprocess.run(["systemd-analyze", "verify", str(broken), str(broken.parent / timer.name)],
                           capture_output=True, text=True)
        assert v.returncode != 0

    # what the service runs, with its environment: the re-profile of every model (none here: exit 10)
    lines = service.read_text().splitlines()
    command = shlex.split(next(x for x in lines if x.startswith("ExecStart="))[len("ExecStart="):])
    unit_env = dict(shlex.split(x[len("Environment="):])[0].split("=", 1) for x in lines if x.startswith("Environment="))
    assert command[1:] == ["-m", "moeplug", "reprofile", "--all"] and Path(command[0]).is_absolute()
    assert unit_env == {v: env[v] for v in XDG}
    run = subprocess.run(command, env={"PATH": "/usr/bin:/bin", **unit_env}, capture_output=True, text=True)
    assert run.returncode == 10, run.stderr
    assert len(log_lines(env)) == 1 and "exit 10: no installed model" in log_lines(env)[0]

    status = json.loads(moeplug(env, "schedule", "status", "--json").stdout)
    assert status["kind"] == "systemd" and status["files"] == doc["files"] and status["last_runs"] == log_lines(env)
    removed = json.loads(moeplug(env, "schedule", "remove", "--json").stdout)
    assert sorted(removed["files"]) == sorted(doc["files"]) and not service.exists() and not timer.exists()
    assert json.loads(moeplug(env, "schedule", "status", "--json").stdout)["kind"] == "none"


@pytest.fixture
def crontab(env: dict[str, str], tmp_path: Path):
    """The user's real crontab (saved, and put back after) when `crontab` is installed; else a file."""
    if shutil.which("crontab"):
        saved = subprocess.run(["crontab", "-l"], capture_output=True, text=True)
        subprocess.run(["crontab", "-"], input="", text=True, check=True)

        def read() -> str:
            return subprocess.run(["crontab", "-l"], capture_output=True, text=True).stdout

        def write(text: str) -> None:
            subprocess.run(["crontab", "-"], input=text, text=True, check=True)

        try:
            yield read, write
        finally:
            if saved.returncode == 0:
                write(saved.stdout)
            else:
                subprocess.run(["crontab", "-r"], capture_output=True)
    else:
        path = tmp_path / "crontab"
        env["MOEPLUG_CRONTAB_FILE"] = str(path)
        yield (lambda: path.read_text() if path.exists() else ""), (lambda text: path.write_text(text))


def test_crontab_line_installs_once_runs_the_reprofile_and_comes_out(env: dict[str, str], crontab) -> None:
    read, write = crontab
    mine = "# my own job\n17 4 * * * /bin/true\n"
    write(mine)
    for _ in range(2):  # installing again replaces moeplug's line, nothing else
        r = moeplug(env, "schedule", "install", "--cron", "--every", "30m", "--json")
        assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    table = read()
    assert table.startswith(mine) and table.count(doc["cron_line"]) == 1 and table.count(">>> moeplug reprofile") == 1
    fields = doc["cron_line"].split(None, 5)
    assert fields[:5] == ["*/30", "*", "*", "*", "*"]
    run = subprocess.run(["/bin/sh", "-c", fields[5]], env={"PATH": "/usr/bin:/bin"}, capture_output=True)
    assert run.returncode == 10  # cron's shell, cron's PATH: it re-profiled every model (none here)
    assert "exit 10: no installed model" in log_lines(env)[-1]

    status = json.loads(moeplug(env, "schedule", "status", "--json").stdout)
    assert status["cron_line"] == doc["cron_line"] and status["enabled"] and status["last_runs"] == log_lines(env)
    r = moeplug(env, "schedule", "remove")
    assert r.returncode == 0 and "crontab line" in r.stdout
    assert read() == mine


def test_without_systemd_the_line_is_printed_not_installed(env: dict[str, str]) -> None:
    from moeplug.operations.schedule import systemd_user_available

    if systemd_user_available():
        pytest.skip("a systemd user manager answers here: install writes the timer")
    env["MOEPLUG_CRONTAB_FILE"] = str(Path(env["XDG_STATE_HOME"]) / "crontab")
    r = moeplug(env, "schedule", "install", "--every", "1d")
    assert r.returncode == 0 and "crontab line: 0 3 * * * " in r.stdout and "--cron" in r.stdout
    assert not Path(env["MOEPLUG_CRONTAB_FILE"]).exists()
    assert not (Path(env["XDG_CONFIG_HOME"]) / "systemd").exists()


@pytest.mark.parametrize("every", ["banana", "0h", "30s"])
def test_a_bad_period_is_one_line(env: dict[str, str], every: str) -> None:
    r = moeplug(env, "schedule", "install", "--user", "--every", every)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--every" in r.stderr
    r = moeplug(env, "schedule", "install", "--cron", "--every", "7m")  # cron cannot divide the hour by 7
    assert r.returncode == 2 and "--every" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.native
def test_installed_demo_is_reprofiled_by_the_schedule_and_a_model_served_without_recording_is_skipped(
        patched_build, tmp_path: Path) -> None:
    """As a new user: `moeplug install demo` (recording and counters on by default), some traffic,
    `moeplug schedule install --cron`, and the scheduled command run as cron runs it: it re-profiles
    from the server's live counts, no error. Served again with --no-record: `schedule install` names
    it, and the scheduled run reports it skipped, with why, and does not fail. `moeplug stop demo`
    prints its two lines in order."""
    import requests

    env = xdg_homes(tmp_path)
    env["MOEPLUG_CRONTAB_FILE"] = str(tmp_path / "crontab")
    try:
        r = run_cli_process("install", "demo", "--ctx", "1024", "--json", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        server = json.loads(r.stdout)["server"]
        assert "--moe-cache-record" in server["args"] and "--metrics" in server["args"]
        # the start-up check's full-context request is neither shown nor learned: nothing counted yet
        status = json.loads(run_cli_process("status", "--json", env=env).stdout)["servers"][0]
        assert status["cache_counters"]["selections"] == 0 and status["metrics"]["decode_tokens"] == 0
        assert requests.get(f"{server['url']}/moe-cache/profile", timeout=30).status_code == 200
        for prompt in ("def main():", "The weather today", "SELECT * FROM"):
            done = requests.post(f"{server['url']}/completion", json={"prompt": prompt, "n_predict": 16,
                                                                      "temperature": 0}, timeout=300)
            assert done.status_code == 200
        # the build that answers, as clients see it: llama.cpp's tag, the source and the patch series
        from moeplug.native.build import build_info, load_spec

        number, commit = build_info(load_spec(), stock=False)
        assert (number, commit.split("-moeplug.")[0]) == (11434, f"sdist.{load_spec().lock.sha256[:8]}")
        chat = requests.post(f"{server['url']}/v1/chat/completions", timeout=300,
                             json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert chat.json()["system_fingerprint"] == f"b11434-{commit}" != "b0-unknown", chat.json()

        r = run_cli_process("schedule", "install", "--cron", "--every", "6h", "--args", "--apply never", "--json",
                            env=env)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["not_reprofiled"] == []
        command = doc["cron_line"].split(None, 5)[5]
        run = subprocess.run(["/bin/sh", "-c", command], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                             timeout=900)
        assert run.returncode in (0, 10), log_lines(env)  # re-planned, or nothing worth it: never an error
        assert f" exit {run.returncode}: demo: " in log_lines(env)[-1] and "source live" in log_lines(env)[-1]

        # served without recording: named by schedule install, skipped by the scheduled run
        assert run_cli_process("stop", "demo", env=env).returncode == 0
        r = run_cli_process("serve", "demo", "--no-record", "--json", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "--moe-cache-record" not in json.loads(r.stdout)["server"]["args"]
        r = run_cli_process("schedule", "install", "--cron", "--every", "6h", env=env)
        assert r.returncode == 0 and "not re-profiled: demo: served without --moe-cache-record" in r.stdout, r.stdout
        run = subprocess.run(["/bin/sh", "-c", command], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                             timeout=900)
        assert run.returncode == 10, log_lines(env)  # nothing else to do; the skip is no error
        assert " exit 10: demo: skipped: 'demo' is served without --moe-cache-record" in log_lines(env)[-1]
        r = run_cli_process("reprofile", "--all", "--json", env=env)
        assert r.returncode == 10 and json.loads(r.stdout)["models"][0]["skipped"], r.stdout
        assert run_cli_process("reprofile", "demo", env=env).returncode == 1  # named: still the error, with why

        stop = subprocess.run([sys.executable, "-m", "moeplug", "stop", "demo"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
        assert stop.stdout.splitlines() == ["stopping demo", "demo: stopped"], stop.stdout
    finally:
        run_cli_process("stop", "--all", env=env)
