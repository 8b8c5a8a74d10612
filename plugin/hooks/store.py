"""The hooks moeplug maintains: one record per hook file in ~/.local/state/moeplug/hooks.json,
written atomically under a lock (an install and `moeplug hook watch` may both touch it)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeplug.core.fsutil import write_text_atomic
from moeplug.core.paths import state_dir

TARGETS = ("llama-server", "llama-swap", "llama-swap-file", "ollama")


@dataclass
class HookRecord:
    target: str  # one of TARGETS
    path: str  # the preset file, the llama-swap config dir, the single llama-swap config file, or lib/ollama
    created_file: bool  # moeplug made the file (remove deletes it when nothing of the user's is left)
    models: list[str] = field(default_factory=list)  # the models it held when last written
    ttl: int | None = None  # llama-swap: seconds idle before it unloads a model
    schema: str | None = None  # llama-swap: the config-schema.json given when the hook was added
    updated: float = field(default_factory=time.time)
    error: str | None = None  # why the last regeneration failed, if it did


def store_path() -> Path:
    return state_dir() / "hooks.json"


def read_hooks() -> list[HookRecord]:
    p = store_path()
    if not p.exists():
        return []
    try:
        return [HookRecord(**r) for r in json.loads(p.read_text())["hooks"]]
    except (ValueError, TypeError, KeyError):
        return []  # a store from another version: as if empty, rewritten on the next hook


def write_hooks(records: list[HookRecord]) -> None:
    doc = {"hooks": [asdict(r) for r in sorted(records, key=lambda r: (r.target, r.path))]}
    write_text_atomic(store_path(), json.dumps(doc, indent=2) + "\n")


def find_hook(target: str, path: Path) -> HookRecord | None:
    return next((r for r in read_hooks() if r.target == target and r.path == str(path)), None)


def put_hook(record: HookRecord) -> None:
    others = [r for r in read_hooks() if (r.target, r.path) != (record.target, record.path)]
    write_hooks([*others, record])


def drop_hook(record: HookRecord) -> None:
    write_hooks([r for r in read_hooks() if (r.target, r.path) != (record.target, record.path)])


@contextlib.contextmanager
def hooks_lock() -> Iterator[None]:
    """One writer of hook files and their records at a time (waits for the other)."""
    path = state_dir() / "locks" / "hooks.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
