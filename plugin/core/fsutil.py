"""File-system helpers: nothing the user has is ever left half-written."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError


@contextlib.contextmanager
def atomic_path(dest: Path) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; rename it over `dest` only on success. A file system
    error (a full disk, a read-only folder) is one MoeplugError naming `dest`, left as it was."""
    tmp_path = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        yield tmp_path
        os.replace(tmp_path, dest)
    except OSError as exc:
        try:
            free = f", {shutil.disk_usage(dest.parent).free} bytes free there"
        except OSError:
            free = ""
        raise MoeplugError(f"{dest}: cannot write it ({exc.strerror or exc}{free}); "
                           f"{'left as it was' if dest.exists() else 'not written'}") from None
    finally:
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_gguf(dest: Path, arch: str) -> Iterator[Any]:
    """A gguf.GGUFWriter for the caller's keys and tensors; the file is written and renamed over
    `dest` when the block ends without an error."""
    import gguf

    with atomic_path(dest) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        yield w
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def write_text_atomic(dest: Path, text: str) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `dest`; it becomes `dest` only on success."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
