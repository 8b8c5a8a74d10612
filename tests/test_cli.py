"""The CLI is thin: what a command prints is the library's result, as JSON or as text for people;
progress goes to the caller's callback; `moeplug profile MODEL` is `moeplug profile run MODEL`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import XdgHome, run_cli

from moeplug.operations.actions import plan_model
from moeplug.planner.request import PlanChoices
from moeplug.commands.main import default_subcommands
from moeplug.core.progress import Note


def test_plan_json_is_the_library_plan(fixture_models, home: XdgHome) -> None:
    model = str(fixture_models["gpt-oss"])
    r = run_cli("plan", model, "--vram-budget", "1GiB", "--ctx", "1024", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == plan_model(model, PlanChoices(ctx=1024, vram_budget=1 << 30)).to_json()


def test_plan_for_people(fixture_models, home: XdgHome) -> None:
    r = run_cli("plan", str(fixture_models["qwen3moe"]), "--vram-budget", "2GiB", "--ctx", "1024")
    assert r.returncode == 0, r.stderr
    assert "KV cache (1024 tokens)" in r.stdout and "8 of 8 per layer" in r.stdout
    assert "server args: -c 1024 -ngl 99" in r.stdout and not r.stdout.lstrip().startswith("{")


def test_profile_model_is_profile_run() -> None:
    assert default_subcommands(["profile", "m.gguf", "-n", "8"]) == ["profile", "run", "m.gguf", "-n", "8"]
    assert default_subcommands(["--debug", "profile", "--prompts", "x", "m.gguf"])[:3] == ["--debug", "profile", "run"]
    for argv in (["profile", "analyze", "p.gguf"], ["profile", "merge", "o", "a"], ["profile", "--help"],
                 ["plan", "profile"], ["profile"]):
        assert default_subcommands(argv) == argv


def test_profile_usage_errors_are_one_line(tmp_path: Path) -> None:
    r = run_cli("profile")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "run,analyze,merge" in r.stderr
    r = run_cli("profile", "merge", str(tmp_path / "out.gguf"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    r = run_cli("profile", str(tmp_path / "absent.gguf"))  # run: the model is read first
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "absent.gguf" in r.stderr


def test_library_progress_goes_to_the_callback(home: XdgHome, capsys: pytest.CaptureFixture[str]) -> None:
    from moeplug.model.demo import ensure_demo_model

    events: list[object] = []
    path = ensure_demo_model(progress=events.append)
    assert path.exists() and any(isinstance(e, Note) and "generating the demo model" in e.text for e in events)
    assert capsys.readouterr() == ("", "")  # the library printed nothing itself
    events.clear()
    ensure_demo_model(progress=events.append)
    assert events == []  # already made: nothing to report


def test_stop_reports_and_returns_what_it_did(home: XdgHome) -> None:
    from moeplug.operations.actions import stop

    events: list[object] = []
    result = stop("nothing", progress=events.append)
    assert (result.names, result.stopped, result.exit_code) == (["nothing"], [], 1)
    assert events == [] and result.to_json() == {"stopped": []}  # nothing to stop: no "stopping" note
    assert stop(all_served=True).exit_code == 0  # nothing served: nothing to stop, not an error
    r = run_cli("stop")
    assert r.returncode == 1 and r.stderr == "moeplug: error: name a served model, or pass --all\n"
    r = run_cli("stop", "nothing", "--json")
    assert r.returncode == 1 and json.loads(r.stdout) == {"stopped": []} and "stopping" not in r.stderr


def _unbreakable(line: str) -> bool:
    """A line that is one word (a long path or pattern) after its indentation, with a shell ' \\' at most."""
    return len(line.strip().removesuffix(" \\").split()) == 1


def test_plan_table_fits_80_columns(fixture_models, home: XdgHome) -> None:
    """`moeplug plan` as a user runs it on an 80-column terminal (COLUMNS=80): no line is wider, the
    long values wrap under their own column, and the server args stay one shell command."""
    import os
    import shlex

    from helpers import run_cli_process

    model = str(fixture_models["qwen3moe"])
    env = dict(os.environ, COLUMNS="80")
    r = run_cli_process("plan", model, "--vram-budget", "2GiB", "--ctx", "1024", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line for line in lines if len(line) > 80 and not _unbreakable(line)] == [], r.stdout
    assert lines[0] == "plan" and lines[2].startswith("VRAM budget") and "2.00 GiB" in lines[2]
    batch = lines.index(next(line for line in lines if line.startswith("prompt batch ")))
    assert lines[batch + 1].startswith(" " * 20), "a long value goes on under its column"
    start = next(i for i, line in enumerate(lines) if line.startswith("server args: "))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith(" \\"))
    joined = " ".join(line.removesuffix(" \\").strip() for line in lines[start:end + 1]).removeprefix("server args: ")
    assert shlex.split(joined) == plan_model(model, PlanChoices(ctx=1024, vram_budget=2 << 30)).server_args

    wide = run_cli_process("plan", model, "--vram-budget", "2GiB", "--ctx", "1024", env=dict(env, COLUMNS="250"),
                           timeout=300)
    assert wide.returncode == 0 and len(wide.stdout.splitlines()) < len(lines)  # one line a row where it fits


def test_stop_says_was_not_running_alone(home: XdgHome) -> None:
    """`moeplug stop NAME` for a model not served: its one line, no "stopping" note before or after it."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moeplug", "stop", "demo"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=dict(os.environ), timeout=120)
    assert r.stdout.splitlines() == ["demo: was not running"], r.stdout
