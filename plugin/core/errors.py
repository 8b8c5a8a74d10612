"""Errors the CLI turns into one line on stderr and a documented exit code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

# Exit codes (also listed in README.md and `moeplug --help`).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_APPLICABLE = 3  # e.g. a dense model, or a plan that does not fit
EXIT_BUILD_FAILED = 4  # the native build (download, patch, cmake) failed
EXIT_NOTHING_TO_DO = 10  # `moeplug reprofile`: the new routing would not gain enough to re-plan (for cron)
EXIT_INTERRUPTED = 130


class MoeplugError(Exception):
    """An error with a message meant for the user and an exit code."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NotApplicableError(MoeplugError):
    """The input is valid but moeplug has nothing to do with it (dense model, no fit)."""

    exit_code = EXIT_NOT_APPLICABLE


class GGUFError(MoeplugError):
    """A file is not a readable GGUF, or a split is incomplete."""


class BuildError(MoeplugError):
    """The native build failed; the message names the log file."""

    exit_code = EXIT_BUILD_FAILED


@contextlib.contextmanager
def about_file(path: Path, error: type[MoeplugError], what: str) -> Iterator[None]:
    """Reading a file: an `error` gets the path in front; a KeyError, ValueError, IndexError or
    TypeError of a malformed file becomes one `error` ('malformed {what}') too."""
    try:
        yield
    except error as exc:
        raise error(f"{path}: {exc}") from None
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise error(f"{path}: malformed {what} ({type(exc).__name__}: {exc})") from None
