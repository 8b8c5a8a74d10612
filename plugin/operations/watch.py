"""`moeplug hook watch`: regenerate the hooks when the model store or the profiles change behind
moeplug's back (a record copied in or deleted, a profile replaced by cron), for use as a user
service. watchdog reports the file events; a burst of them (an atomic write is a create and a
rename) is handled once, `debounce` seconds after the last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from moeplug.core.progress import Note, ProgressFn, silent

DEBOUNCE_S = 0.3


@dataclass
class Changes:
    """What changed since the last regeneration."""

    profiles: set[Path] = field(default_factory=set)  # profile files created, replaced or removed
    models: set[Path] = field(default_factory=set)  # installed-model records created, replaced or removed
    binaries: set[Path] = field(default_factory=set)  # a hooked lib/ollama/llama-server written (an Ollama update?)


def _relevant(path: str, folder: Path, suffix: str) -> Path | None:
    p = Path(path)
    if p.parent != folder or p.suffix != suffix or p.name.startswith("."):
        return None  # another folder, another kind of file, or a temporary one (.NAME.XXXX.tmp)
    return p


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type in ("opened", "closed_no_write"):
            return
        paths = [event.src_path, getattr(event, "dest_path", "") or ""]
        for raw in paths:
            if not raw:
                continue
            raw = raw.decode() if isinstance(raw, bytes) else raw
            w = self.watcher
            if (p := _relevant(raw, w.profiles_dir, ".gguf")) is not None:
                w.mark(profile=p)
            elif (p := _relevant(raw, w.models_dir, ".json")) is not None:
                w.mark(model=p)
            elif Path(raw).parent in w.binary_dirs and Path(raw).name == "llama-server":
                w.mark(binary=Path(raw))


class Watcher:
    """Watch two folders; call `on_change(Changes)` from one thread, debounced."""

    def __init__(self, models_dir: Path, profiles_dir: Path, on_change: Callable[[Changes], None],
                 debounce: float = DEBOUNCE_S, progress: ProgressFn = silent, binary_dirs: tuple[Path, ...] = ()) -> None:
        self.models_dir, self.profiles_dir = models_dir.absolute(), profiles_dir.absolute()
        self.binary_dirs = tuple(d.absolute() for d in binary_dirs)  # hooked lib/ollama folders
        self.on_change, self.debounce, self.progress = on_change, debounce, progress
        self._lock = threading.Lock()
        self._pending = Changes()
        self._last = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._observer = Observer()
        self._worker = threading.Thread(target=self._run, name="moeplug-hook-watch", daemon=True)

    def mark(self, profile: Path | None = None, model: Path | None = None, binary: Path | None = None) -> None:
        with self._lock:
            if profile is not None:
                self._pending.profiles.add(profile)
            if model is not None:
                self._pending.models.add(model)
            if binary is not None:
                self._pending.binaries.add(binary)
            self._last = time.monotonic()
        self._wake.set()

    def start(self) -> None:
        for folder in (self.models_dir, self.profiles_dir):
            folder.mkdir(parents=True, exist_ok=True)
            self._observer.schedule(_Handler(self), str(folder), recursive=False)
        for folder in self.binary_dirs:
            if folder.is_dir():
                self._observer.schedule(_Handler(self), str(folder), recursive=False)
        self._observer.start()
        self._worker.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._observer.stop()
        self._observer.join(timeout=5)
        self._worker.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            while not self._stop.is_set():
                with self._lock:
                    left = self._last + self.debounce - time.monotonic()
                    if left <= 0:
                        changes, self._pending = self._pending, Changes()
                        self._wake.clear()
                        break
                time.sleep(left)
            if not self._stop.is_set() and (changes.profiles or changes.models or changes.binaries):
                try:
                    self.on_change(changes)
                except Exception as exc:  # a bad record or file must not end the service
                    self.progress(Note(f"hook watch: {type(exc).__name__}: {exc}"))


def regenerate(changes: Changes) -> None:
    """What `moeplug hook watch` does on a change: re-plan the installed models whose profile was
    replaced (which rewrites the hooks), else rewrite the hooks from the installed models."""
    from moeplug.hooks.maintain import refresh_hooks
    from moeplug.serving.installed import list_installed
    from moeplug.operations.install import replan_profile_users

    for binary in sorted(changes.binaries):
        reapply_ollama(binary.parent)
    replanned = [m for p in sorted(changes.profiles) for m in replan_profile_users(p)]
    if changes.models or (changes.profiles and not replanned):
        refresh_hooks(list_installed())


def reapply_ollama(lib_dir: Path) -> None:
    """Ollama replaced the llama-server of a hooked lib/ollama (an update): swap moeplug's in again,
    after the same check as `moeplug hook ollama` (a refusal is raised: the watcher reports it)."""
    from moeplug.hooks import ollama
    from moeplug.hooks.maintain import add_ollama_hook
    from moeplug.serving.installed import list_installed

    if ollama.binary_state(lib_dir) == "replaced":
        add_ollama_hook(ollama.OllamaInstall(lib_dir, None), list_installed())


def watch_store(on_change: Callable[[Changes], None] = regenerate, debounce: float = DEBOUNCE_S,
                progress: ProgressFn = silent) -> Watcher:
    """A started watcher of moeplug's installed models and profiles (stop() it when done)."""
    from moeplug.serving.installed import installed_dir
    from moeplug.core.paths import data_dir

    from moeplug.hooks.store import read_hooks

    w = Watcher(installed_dir(), data_dir() / "profiles", on_change, debounce, progress,
                tuple(Path(r.path) for r in read_hooks() if r.target == "ollama"))
    w.start()
    return w
