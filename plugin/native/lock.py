"""The pinned llama.cpp (native/lock.yaml) and where our patch series and overlay live."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml
from moeplug.core.errors import MoeplugError
from moeplug.core.paths import bundled_dir


def native_dir() -> Path:
    """native/ of a source checkout, or the copy packaged into an installed wheel."""
    return bundled_dir("native", "_native", "lock.yaml")


@dataclass(frozen=True)
class Lock:
    upstream: str
    tag: str
    package: str
    version: str
    filename: str
    sha256: str
    subdir: str
    text: str  # the file as written, hashed into build ids

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class NativeSpec:
    """Everything that defines the patched source: the lock, the patches and the overlay."""

    lock: Lock
    patches: tuple[Path, ...]
    overlay_dir: Path

    @property
    def overlay_files(self) -> tuple[Path, ...]:
        """Overlay files relative to overlay_dir, in a stable order."""
        if not self.overlay_dir.is_dir():
            return ()
        return tuple(sorted(p.relative_to(self.overlay_dir) for p in self.overlay_dir.rglob("*") if p.is_file()))

    def digest(self, stock: bool) -> str:
        """Hash of what goes into the source tree (stock: the lock alone)."""
        h = hashlib.sha256(self.lock.text.encode())
        if not stock:
            for patch in self.patches:
                h.update(b"patch\0" + patch.name.encode() + b"\0" + patch.read_bytes())
            for rel in self.overlay_files:
                h.update(b"file\0" + str(rel).encode() + b"\0" + (self.overlay_dir / rel).read_bytes())
        return h.hexdigest()


def read_lock(path: Path) -> Lock:
    try:
        text = path.read_text(encoding="utf-8")
        doc = yaml.safe_load(text)
        src = doc["source"]
        return Lock(
            upstream=str(doc["upstream"]), tag=str(doc["tag"]), package=str(src["package"]),
            version=str(src["version"]), filename=str(src["filename"]), sha256=str(src["sha256"]).lower(),
            subdir=str(src["subdir"]), text=text,
        )
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise MoeplugError(f"{path}: unreadable lock file ({exc})") from exc


def load_spec(root: Path | None = None) -> NativeSpec:
    root = root or native_dir()
    patches = tuple(sorted((root / "patches").glob("*.patch")))
    return NativeSpec(lock=read_lock(root / "lock.yaml"), patches=patches, overlay_dir=root / "overlay")
