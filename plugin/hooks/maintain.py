"""Adding, regenerating and removing the hooks moeplug maintains.

`refresh_hooks(models)` is the one call the library makes after anything that changes an
installed model's plan (install, re-plan, profile change, removal): every recorded hook is
rewritten from the installed models' plans; a hook that cannot be written (the user broke the
file, a clash) is reported and recorded, never fatal to the command that triggered it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from moeplug.core.errors import MoeplugError
from moeplug.hooks import llama_server_presets as presets
from moeplug.hooks import llama_swap, ollama, plan_files
from moeplug.hooks.command import ModelCommand, model_commands
from moeplug.hooks.installed import Installed
from moeplug.hooks.files import read_text_exact, replace_keeping
from moeplug.hooks.store import HookRecord, drop_hook, find_hook, hooks_lock, put_hook, read_hooks
from moeplug.core.progress import Note, ProgressFn, silent


def hook_file(target: str, path: Path) -> Path:
    """The file a hook writes: the preset, DIR/moeplug.yaml, or the single llama-swap config."""
    if target == "ollama":
        return path / ollama.SERVER
    return path / llama_swap.FRAGMENT_NAME if target == "llama-swap" else path


def hook_state(record: HookRecord) -> str:
    """'ok', the last regeneration's error, or for Ollama a binary replaced since (an update)."""
    if record.target == "ollama" and ollama.binary_state(Path(record.path)) != "swapped":
        return (f"{hook_file(record.target, Path(record.path))} is not moeplug's any more (an Ollama update?): "
                f"run 'moeplug hook ollama' again")
    return f"error: {record.error}" if record.error else "ok"


def _write(record: HookRecord, commands: list[ModelCommand], models: Sequence[Installed] = ()) -> bool:
    """The hook's file and the plan files its commands name (plan_files), brought up to date; True when
    either changed."""
    path, schema = Path(record.path), Path(record.schema) if record.schema else None
    ttl = record.ttl if record.ttl is not None else llama_swap.DEFAULT_TTL
    plans = plan_files.write_plan_files(models)
    if record.target == "llama-server":
        return presets.write_preset(path, commands) or plans
    if record.target == "llama-swap":
        return llama_swap.write_fragment(path, commands, ttl, schema) or plans
    if record.target == "llama-swap-file":
        return llama_swap.write_file(path, commands, ttl, schema) or plans
    if record.target == "ollama":
        return ollama.refresh_environment(models) or plans
    raise MoeplugError(f"unknown hook target '{record.target}'")


def add_hook(target: str, path: Path, models: Sequence[Installed], ttl: int | None = None,
             schema: Path | None = None) -> tuple[HookRecord, bool]:
    """Write a hook now and record it, so that later changes regenerate it; (record, changed)."""
    path = path.expanduser().absolute()
    with hooks_lock():
        old = find_hook(target, path)
        record = HookRecord(target=target, path=str(path),
                            created_file=old.created_file if old else not hook_file(target, path).exists(),
                            ttl=ttl if ttl is not None else (old.ttl if old else None),
                            schema=str(schema.absolute()) if schema else (old.schema if old else None))
        commands = model_commands(list(models))
        changed = _write(record, commands, models)
        record.models = [c.name for c in commands]
        put_hook(record)
    return record, changed


def refresh_hooks(models: Sequence[Installed], progress: ProgressFn = silent) -> list[HookRecord]:
    """Rewrite every recorded hook from these installed models; the records, each with its error
    (progress hears which file changed, and which could not be written)."""
    records = read_hooks()
    if not records:
        return []
    with hooks_lock():
        records = read_hooks()
        for record in records:
            try:
                commands = model_commands(list(models))  # per hook: its error is recorded with it
                if _write(record, commands, models):
                    progress(Note(f"hook {record.target}: updated {hook_file(record.target, Path(record.path))}"))
                record.models, record.error = [c.name for c in commands], None
            except (MoeplugError, OSError) as exc:  # e.g. the user's file made read-only
                record.error = str(exc)
                progress(Note(f"hook {record.target} {record.path}: not updated: {exc}"))
            record.updated = time.time()
            put_hook(record)
    return records


def add_ollama_hook(install: ollama.OllamaInstall, models: Sequence[Installed],
                    progress: ProgressFn = silent) -> tuple[HookRecord, str]:
    """`moeplug hook ollama`: check that moeplug's llama-server accepts what Ollama passes, swap it
    in (the bundled files backed up), write a plan file beside every installed model's profile
    and the environment; (record, what to do next). Refused with nothing changed when the check
    fails or lib/ollama cannot be written."""
    from moeplug.native.build import build, resolve_options

    result = build(resolve_options(None, stock=False, jobs=0, cuda_arch=None), progress=progress)
    ours = result.binary(ollama.SERVER)
    bundled_path = install.lib_dir / ollama.SERVER
    if ollama.binary_state(install.lib_dir) == "swapped":
        bundled_path = ollama.backup_dir(install.lib_dir) / ollama.SERVER  # the backup: Ollama's own
    bundled = ollama.server_info(bundled_path, [bundled_path.parent, install.lib_dir])
    ollama.check_compatible(ollama.server_info(ours, [ours.parent]), bundled, install.executable)
    ollama.check_writable(install.lib_dir)
    with hooks_lock():
        ollama.swap_in(install, ours.parent, result.build_id, progress)
        record = HookRecord(target="ollama", path=str(install.lib_dir), created_file=False)
        _write(record, [], models)
        record.models = sorted(m.name for m in models if m.profile)
        put_hook(record)
        _, next_step = ollama.write_environment(models)
    return record, f"{bundled.version} backed up; {next_step}"


def remove_hook(record: HookRecord) -> None:
    """Take moeplug's part out of the hook's file (the whole file when moeplug made it and nothing
    else is left in it) and forget the hook; Ollama gets its bundled files back."""
    path = Path(record.path)
    with hooks_lock():
        if record.target == "ollama":
            for note in ollama.restore(path):
                record.error = note
            ollama.remove_environment()
        elif record.target == "llama-swap":
            (path / llama_swap.FRAGMENT_NAME).unlink(missing_ok=True)
        elif path.exists():
            old = read_text_exact(path)
            if record.target == "llama-server":
                new = presets.merge(old, [], str(path))
            else:
                new = llama_swap.merge_file(old, [], str(path))
            if record.created_file and not new.strip():
                path.unlink()
            elif new != old:
                replace_keeping(path, old, new)
        drop_hook(record)


def find(target: str | None, path: Path) -> HookRecord:
    path = path.expanduser().absolute()
    hits = [r for r in read_hooks() if r.path == str(path) and (target is None or r.target == target)]
    if not hits:
        known = ", ".join(f"{r.target} {r.path}" for r in read_hooks()) or "none"
        raise MoeplugError(f"moeplug maintains no hook at {path} (hooks: {known})")
    return hits[0]
