"""Every numeric option of every command, walked from the parser itself: 0, -1, a huge number and a
non-number are each accepted with a meaning the help states, or refused with one line and exit 2
before anything runs; and a context above the model's training context is refused where the
model is read, unless --ctx-override.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import XdgHome, fixture_spec, run_cli

from moeplug.commands.main import build_parser, default_subcommands
from moeplug.commands.options import NUMERIC_TYPES
from moeplug.model.synth import make_model

BAD_VALUES = ("0", "-1", "100000000000000000000", "banana")


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every leaf command's parser, with the words that reach it. argparse has no public walk."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from subcommands(child, (*path, name))


def required(parser: argparse.ArgumentParser) -> list[str]:
    """Placeholders for the positionals and required options, so that only the option under test is bad."""
    args = ["x" for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    return args + [word for a in parser._actions if a.option_strings and a.required for word in (a.option_strings[0], "x")]


def value_options() -> list[tuple[tuple[str, ...], argparse.ArgumentParser, argparse.Action]]:
    return [(path, p, a) for path, p in subcommands(build_parser()) for a in p._actions
            if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)]


def test_the_walk_sees_every_command() -> None:
    paths = {path for path, _ in subcommands(build_parser())}
    assert {("install",), ("plan",), ("serve",), ("profile", "run"), ("profile", "analyze"), ("dev", "make-model"),
            ("native", "build")} <= paths
    numeric = {(path, a.dest) for path, _, a in value_options() if isinstance(a.type, NUMERIC_TYPES)}
    assert {(("install",), "ctx"), (("install",), "port"), (("install",), "vram_budget"), (("serve",), "port"),
            (("profile", "run"), "n_predict"), (("native", "build"), "jobs")} <= numeric


def test_no_numeric_option_goes_unchecked() -> None:
    """A plain int or float type takes -1 and 10**20: every number goes through moeplug.commands.options."""
    raw = [f"{' '.join(path)} {a.option_strings[0]}" for path, _, a in value_options() if a.type in (int, float)]
    assert raw == []


@pytest.mark.parametrize("value", BAD_VALUES)
def test_each_numeric_option_accepts_with_meaning_or_refuses_in_one_line(value: str) -> None:
    checked = 0
    for path, parser, action in value_options():
        if not isinstance(action.type, NUMERIC_TYPES):
            continue
        argv = [*path, *required(parser), action.option_strings[0], value]
        try:
            parsed = build_parser().parse_args(default_subcommands(argv))
        except SystemExit:
            parsed = None
        if parsed is None:
            r = run_cli(*argv)  # the whole CLI: refused while parsing, before any command runs
            assert r.returncode == 2, (argv, r)
            assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (argv, r.stderr)
            assert action.option_strings[0] in r.stderr or action.option_strings[-1] in r.stderr, (argv, r.stderr)
            assert r.stdout == ""
        else:
            got = getattr(parsed, action.dest)
            # only 0 may be accepted, and then with a meaning the help names
            assert value == "0" and got in (0, [0]), (argv, got)
            assert "0" in (action.help or ""), f"{' '.join(argv)}: accepted, but the help does not say what 0 means"
        checked += 1
    assert checked >= 30


@pytest.fixture(scope="module")
def short_ctx_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model trained with a 2048-token context."""
    path = tmp_path_factory.mktemp("ctx") / "short.gguf"
    return make_model(replace(fixture_spec("qwen3moe"), ctx=2048), path)[0]


def test_ctx_above_training_context_needs_override(short_ctx_model: Path, home: XdgHome) -> None:
    r = run_cli("plan", str(short_ctx_model), "--ctx", "4096", "--vram-budget", "2GiB", "--json")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stdout == ""
    assert "above the model's training context (2048)" in r.stderr and "--ctx-override" in r.stderr
    r = run_cli("plan", str(short_ctx_model), "--ctx", "4096", "--ctx-override", "--vram-budget", "2GiB", "--json")
    assert r.returncode == 0, r.stderr
    args = json.loads(r.stdout)["server_args"]
    assert args[args.index("-c") + 1] == "4096"


def test_default_ctx_is_capped_at_the_training_context(short_ctx_model: Path, home: XdgHome) -> None:
    r = run_cli("plan", str(short_ctx_model), "--vram-budget", "2GiB", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ctx"] == 2048 and doc["server_args"][doc["server_args"].index("-c") + 1] == "2048"


@pytest.mark.parametrize("ctx", ["-1", "0", "8192"])
def test_install_refuses_a_bad_ctx_before_writing_anything(ctx: str, home: XdgHome) -> None:
    """The issue's report: `install demo --ctx -1 --no-serve` planned `-c -1`. Refused now, with
    nothing installed; 8192 is above the demo model's training context (4096)."""
    r = run_cli("install", "demo", "--ctx", ctx, "--no-serve")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("moeplug: error:")]
    assert len(errors) == 1 and "--ctx" in errors[0] and r.stderr.endswith(errors[0] + "\n")  # after progress notes
    assert not (home.data / "installed").exists()
