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
from pathlib import Path

import pytest
from helpers import CliResult, moeplug, run_cli_process, xdg_homes

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
