"""What a proxy needs to start one installed model: moeplug's patched llama-server, the model
file and the installed plan's server args (the very list `moeplug serve` runs), and its env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from moeplug.core.errors import MoeplugError


class Installed(Protocol):
    """The parts of moeplug.serving.installed.InstalledModel a hook reads."""

    name: str
    ref: str
    path: str
    profile: str | None
    build_id: str
    plan: Any  # planner.record.Plan
    placement: str  # serving.installed.PLACEMENTS

    def server_env(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class ModelCommand:
    name: str
    ref: str  # what it was installed from
    binary: Path  # the patched llama-server of the model's build
    model: Path
    server_args: tuple[str, ...]  # the installed plan's
    env: tuple[tuple[str, str], ...]
    profile: Path | None
    profile_sha256: str | None  # the profile file's digest now (a replaced profile shows in the fragment)

    def argv(self, port: int | str) -> list[str]:
        from moeplug.serving.launch import served_argv

        return served_argv(self.binary, self.model, port, list(self.server_args))


def model_commands(models: list[Installed]) -> list[ModelCommand]:
    """One command per installed model, sorted by name; a model whose build is gone is an error."""
    from moeplug.native.build import installed_builds

    builds = {b.build_id: b for b in installed_builds()}
    out = []
    for m in sorted(models, key=lambda m: m.name):
        if m.build_id not in builds:
            raise MoeplugError(f"the build {m.build_id} that '{m.name}' was installed with is gone; "
                               f"run 'moeplug install {m.ref}' again")
        args, env = _served(m)
        out.append(ModelCommand(name=m.name, ref=m.ref, binary=builds[m.build_id].binary("llama-server"),
                                model=Path(m.path), server_args=tuple(args), env=tuple(sorted(env.items())),
                                profile=Path(m.profile) if m.profile else None, profile_sha256=_digest(m.profile)))
    return out


def _served(m: Installed) -> tuple[list[str], dict[str, str]]:
    """What a proxy runs a model with: its plan's flags and environment, or stock --fit's placement
    where the install's check found the plan slower here (planner.server_flags.stock_args, with the
    GPUs' free memory now)."""
    if m.placement != "stock":
        return list(m.plan.server_args), m.server_env()
    from moeplug.planner.server_flags import stock_args

    return stock_args(m.plan), {}


def _digest(path: str | None) -> str | None:
    from moeplug.core.fsutil import sha256_file

    try:
        return sha256_file(Path(path)) if path else None
    except OSError:
        return None


def flag_pairs(server_args: tuple[str, ...] | list[str]) -> list[tuple[str, str | None]]:
    """('-c', '4096'), ('--cpu-moe', None), ...: each flag with its value (None: a switch). A token
    after a flag is its value unless it is itself a flag (a negative number is a value)."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(server_args):
        flag = server_args[i]
        if not _is_flag(flag):
            raise MoeplugError(f"server args: '{flag}' is not a flag (args: {' '.join(server_args)})")
        value = server_args[i + 1] if i + 1 < len(server_args) and not _is_flag(server_args[i + 1]) else None
        pairs.append((flag, value))
        i += 2 if value is not None else 1
    return pairs


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True
