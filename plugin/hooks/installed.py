"""What a hook reads of an installed model: the parts of its record (Installed) and its plan's
server args as flag and value pairs (flag_pairs)."""

from __future__ import annotations

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
