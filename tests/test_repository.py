"""The repository's promises to a newcomer: the README's commands and what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    block = re.search(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md must open with a ```sh block holding the two commands"
    return [line for line in block[1].splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("moeplug install demo")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_no_llama_cpp_source_in_the_repository() -> None:
    """Only our patches and our own files: no upstream tree, nothing built from it."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for marker in ("ggml/src/ggml.c", "src/llama.cpp", "CMakePresets.json", "ggml/include/ggml.h"):
        assert not any(path.endswith(marker) for path in tracked)
    assert [p for p in tracked if (ROOT / p).stat().st_size > 1_000_000] == []
