"""Changing a file the user owns: read it byte for byte, replace it atomically with its mode kept,
and keep the first version moeplug changed as FILE.moeplug-backup."""

from __future__ import annotations

import os
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.core.fsutil import atomic_path

BACKUP_SUFFIX = ".moeplug-backup"


def read_text_exact(path: Path) -> str:
    try:
        raw = path.read_bytes() if path.exists() else b""
    except OSError as exc:
        raise MoeplugError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MoeplugError(f"{path}: not a text file (not UTF-8), left as it was") from None


def replace_keeping(path: Path, old: str, new: str) -> None:
    """Replace the file atomically with its mode kept; the first version moeplug changes is backed up."""
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    if old and not backup.exists():
        with atomic_path(backup) as tmp:
            tmp.write_bytes(old.encode("utf-8"))
            os.chmod(tmp, mode)
    with atomic_path(path) as tmp:
        tmp.write_bytes(new.encode("utf-8"))
        os.chmod(tmp, mode)
