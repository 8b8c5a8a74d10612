"""Helpers the test modules share (imported as `helpers`; conftest.py holds only fixtures)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import dataclass

from moeplug.synth import ModelSpec

# Small but real: 256-wide rows so every dtype, Q4_K included, applies to the expert tensors.
FIXTURE_SHAPE = dict(layers=3, experts=8, used=2, embd=256, expert_ff=256, heads=4, heads_kv=2, head_dim=64)


def fixture_spec(arch: str, dtype: str = "q8_0", seed: int = 7) -> ModelSpec:
    return ModelSpec(arch=arch, dtype=dtype, seed=seed, **FIXTURE_SHAPE)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str) -> CliResult:
    """`moeplug ARGS` in this process, through moeplug.cli.main: the same parser, commands and error
    handling as the installed command, without a child process (what it prints is captured)."""
    from moeplug.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def run_cli_process(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> CliResult:
    """The real `moeplug` command in a child process (end-to-end tests: servers that outlive it)."""
    r = subprocess.run([sys.executable, "-m", "moeplug", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    return CliResult(r.returncode, r.stdout, r.stderr)
