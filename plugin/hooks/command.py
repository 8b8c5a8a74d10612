"""What a proxy needs to start one installed model: moeplug's patched llama-server, the model
file and the installed plan's server args (the list `moeplug serve` runs, its cache's flags given
as the model's plan file), and its env."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.hooks.installed import Installed
from moeplug.hooks.plan_files import served_args


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
    """What a proxy runs a model with: its plan (one flag naming its plan file, plan_files.served_args,
    beside the plan's other flags) and environment, or stock --fit's placement
    where the install's check found the plan slower here (planner.server_flags.stock_args, with the
    GPUs' free memory now)."""
    if m.placement != "stock":
        return served_args(m), m.server_env()
    from moeplug.planner.server_flags import stock_args

    return stock_args(m.plan), {}


def _digest(path: str | None) -> str | None:
    from moeplug.core.fsutil import sha256_file

    try:
        return sha256_file(Path(path)) if path else None
    except OSError:
        return None
