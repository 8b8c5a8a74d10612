"""Where moeplug keeps things, following the XDG base directory conventions."""

from __future__ import annotations

import os
from pathlib import Path


def _xdg(var: str, default: str) -> Path:
    value = os.environ.get(var)
    return Path(value) if value else Path.home() / default


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config") / "moeplug"


def data_dir() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / "moeplug"


def state_dir() -> Path:
    return _xdg("XDG_STATE_HOME", ".local/state") / "moeplug"


def cache_dir() -> Path:
    return _xdg("XDG_CACHE_HOME", ".cache") / "moeplug"


def bundled_dir(checkout_name: str, package_name: str, marker: str) -> Path:
    """A data folder of the project: `checkout_name` in a source checkout (editable install), or
    the copy a wheel installs beside the package as moeplug/`package_name`. `marker` is a file
    that must be there, so an unrelated folder of the same name is never taken."""
    package = Path(__file__).resolve().parents[1]  # moeplug/, above core/
    checkout = package.parent / checkout_name
    if (checkout / marker).exists():
        return checkout
    return package / package_name


def builds_dir() -> Path:
    """Installed native builds, one folder per build id."""
    return data_dir() / "builds"


def logs_dir() -> Path:
    return state_dir() / "logs"
