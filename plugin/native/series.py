"""What the patch series changes in upstream files: the figures `native/check-series` prints.

The series is applied to the pinned tree as `moeplug native worktree` applies it (a git repository:
the upstream commit, the overlay commit, one commit per patch). Then, per upstream file the series
changes, from the net diff between the overlay commit and the last patch:

- lines added and removed;
- the largest block: the most code lines (not blank, not only a comment) among consecutive added
  lines, the unit of a merge conflict when upstream moves;
- which patches the file's added lines come from (git blame).

Tests and CMake files are listed apart and left out of the totals. The negative expert ids (the
patches whose subject says "negative expert ids": ggml's flag, its CPU ops and the CUDA kernels)
are counted apart too: they are a feature ggml could take on its own, and their lines sit inside
the kernels by nature. Everything else should be a call site or a hook point.

native/series-limits.yaml holds the limits the figures may not grow past (`check_limits`).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from moeplug.core.errors import MoeplugError
from moeplug.native.devloop import OVERLAY_TAG, make_worktree
from moeplug.native.lock import NativeSpec, load_spec, native_dir

EXCEPTION_SUBJECT = "negative expert ids"
LIMITS_FILE = "series-limits.yaml"
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class FileChange:
    path: str
    kind: str  # "code", "test" or "cmake"
    added: int = 0
    removed: int = 0
    exception_added: int = 0  # of `added`, lines of the negative expert ids
    exception_removed: int = 0
    largest_block: int = 0  # code lines, outside the negative expert ids
    largest_block_at: int = 0  # its first line in the patched file
    largest_exception_block: int = 0
    patches: list[str] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return self.added + self.removed

    @property
    def exception_changed(self) -> int:
        return self.exception_added + self.exception_removed

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "added": self.added, "removed": self.removed,
                "changed": self.changed, "negative_ids_changed": self.exception_changed,
                "largest_block": self.largest_block, "largest_block_at": self.largest_block_at,
                "largest_negative_ids_block": self.largest_exception_block, "patches": self.patches}


@dataclass
class SeriesReport:
    tag: str
    n_patches: int
    files: list[FileChange]

    def code_files(self) -> list[FileChange]:
        return [f for f in self.files if f.kind == "code"]

    @property
    def code_changed(self) -> int:
        return sum(f.changed for f in self.code_files())

    @property
    def exception_changed(self) -> int:
        return sum(f.exception_changed for f in self.code_files())

    @property
    def largest_block(self) -> FileChange | None:
        files = self.code_files()
        return max(files, key=lambda f: f.largest_block) if files else None

    def to_json(self) -> dict[str, Any]:
        top = self.largest_block
        return {"tag": self.tag, "patches": self.n_patches, "files": [f.to_json() for f in self.files],
                "code_changed": self.code_changed, "code_added": sum(f.added for f in self.code_files()),
                "code_removed": sum(f.removed for f in self.code_files()),
                "negative_ids_changed": self.exception_changed,
                "largest_block": top.largest_block if top else 0, "largest_block_file": top.path if top else None}


def file_kind(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    if name == "CMakeLists.txt" or name.endswith(".cmake"):
        return "cmake"
    if path.startswith("tests/"):
        return "test"
    return "code"


def is_code_line(text: str) -> bool:
    s = text.strip()
    return bool(s) and not s.startswith(("//", "/*", "*", "#pragma once"))


def _git(tree: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MoeplugError(f"git {args[0]} failed in {tree}: {proc.stderr.strip()[-300:]}")
    return proc.stdout


def _blame(tree: Path, path: str) -> list[str]:
    """The commit of each line of the patched file."""
    commits: list[str] = []
    for line in _git(tree, "blame", "--porcelain", "HEAD", "--", path).splitlines():
        m = re.match(r"^([0-9a-f]{40}) \d+ (\d+)", line)
        if m:
            n = int(m[2])
            while len(commits) < n:
                commits.append("")
            commits[n - 1] = m[1]
    return commits


def _added_runs(diff: str) -> tuple[list[tuple[int, list[str]]], list[tuple[int, int]]]:
    """From a -U0 diff: runs of consecutive added lines (first new line number, texts), and per hunk
    (first new line number, lines removed)."""
    runs: list[tuple[int, list[str]]] = []
    removed: list[tuple[int, int]] = []
    new_line = 0
    for line in diff.splitlines():
        m = _HUNK_RE.match(line)
        if m:
            new_line = int(m[3])
            n_new = int(m[4]) if m[4] is not None else 1
            n_old = int(m[2]) if m[2] is not None else 1
            removed.append((new_line if n_new else new_line + 1, n_old))
            if n_new:
                runs.append((new_line, []))
            continue
        if line.startswith("+") and not line.startswith("+++"):
            runs[-1][1].append(line[1:])
    # hunks that touch join into one run: -U0 cuts a run at every removed line
    joined: list[tuple[int, list[str]]] = []
    for start, texts in runs:
        if joined and joined[-1][0] + len(joined[-1][1]) == start:
            joined[-1][1].extend(texts)
        else:
            joined.append((start, list(texts)))
    return joined, removed


def _blocks(texts: list[str], owners: list[bool]) -> list[tuple[int, int, bool]]:
    """Split a run of added lines where it changes between exception and not: (offset, code lines, exception)."""
    out: list[tuple[int, int, bool]] = []
    for i, (text, exc) in enumerate(zip(texts, owners)):
        if not out or out[-1][2] != exc:
            out.append((i, 0, exc))
        if is_code_line(text):
            off, n, e = out[-1]
            out[-1] = (off, n + 1, e)
    return out


def measure_tree(tree: Path, base: str = OVERLAY_TAG) -> list[FileChange]:
    """The changes of every upstream file between `base` and HEAD in a work tree."""
    subjects = {}
    for line in _git(tree, "log", "--format=%H %s", f"{base}..HEAD").splitlines():
        sha, _, subject = line.partition(" ")
        subjects[sha] = subject
    changes = []
    for stat in _git(tree, "diff", "--numstat", base, "HEAD").splitlines():
        added, removed, path = stat.split("\t", 2)
        fc = FileChange(path=path, kind=file_kind(path), added=int(added), removed=int(removed))
        diff = _git(tree, "diff", "-U0", base, "HEAD", "--", path)
        runs, removals = _added_runs(diff)
        owners = _blame(tree, path)
        patches: dict[str, None] = {}
        exc_lines: set[int] = set()
        for start, texts in runs:
            excs = []
            for k in range(len(texts)):
                subject = subjects.get(owners[start + k - 1] if start + k - 1 < len(owners) else "", "")
                if subject:
                    patches[subject] = None
                exc = EXCEPTION_SUBJECT in subject
                excs.append(exc)
                if exc:
                    exc_lines.add(start + k)
                    fc.exception_added += 1
            for off, n, exc in _blocks(texts, excs):
                if exc:
                    fc.largest_exception_block = max(fc.largest_exception_block, n)
                elif n > fc.largest_block:
                    fc.largest_block, fc.largest_block_at = n, start + off
        for at, n_old in removals:
            # a removal beside lines of the negative ids is theirs
            if at in exc_lines or at - 1 in exc_lines:
                fc.exception_removed += n_old
        fc.patches = [s for s in subjects.values() if s in patches]
        changes.append(fc)
    order = {"code": 0, "test": 1, "cmake": 2}
    return sorted(changes, key=lambda f: (order[f.kind], -f.changed, f.path))


def measure_series(spec: NativeSpec | None = None) -> SeriesReport:
    """Apply the series to the pinned tree in a scratch work tree and measure it."""
    spec = spec or load_spec()
    with tempfile.TemporaryDirectory(prefix="moeplug-series-") as tmp:
        tree = make_worktree(Path(tmp) / "tree", spec)
        files = measure_tree(tree)
    return SeriesReport(tag=spec.lock.tag, n_patches=len(spec.patches), files=files)


def load_limits(root: Path | None = None) -> dict[str, Any]:
    path = (root or native_dir()) / LIMITS_FILE
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise MoeplugError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(doc, dict):
        raise MoeplugError(f"{path}: not a mapping")
    return doc


LIMITS_HEADER = """\
# What the patch series may change in upstream llama.cpp files (tests and CMake aside), as
# `moeplug native check-series` (native/check-series) measures it: lines added plus removed in all and per
# file, the negative expert ids apart, and the largest block of consecutive added code lines outside them.
# tests/test_series.py fails when a figure differs from its limit: a change that grows one is seen, and one
# that lowers it writes the new figures (`moeplug native check-series --write-limits`).
"""


def limits_of(report: SeriesReport) -> dict[str, Any]:
    top = report.largest_block
    return {"code_changed": report.code_changed, "negative_ids_changed": report.exception_changed,
            "largest_block": max(top.largest_block if top else 0, 15),
            "files": {f.path: f.changed for f in report.code_files()}}


def write_limits(report: SeriesReport, root: Path | None = None) -> Path:
    """native/series-limits.yaml from the series' figures (the largest block's limit never below 15)."""
    from moeplug.core.fsutil import write_text_atomic

    doc = limits_of(report)
    lines = [f"code_changed: {doc['code_changed']}", f"negative_ids_changed: {doc['negative_ids_changed']}",
             f"largest_block: {doc['largest_block']}", "files:"]
    lines += [f"  {path}: {n}" for path, n in doc["files"].items()]
    path = (root or native_dir()) / LIMITS_FILE
    write_text_atomic(path, LIMITS_HEADER + "\n".join(lines) + "\n")
    return path


def check_limits(report: SeriesReport, limits: dict[str, Any]) -> list[str]:
    """One line per figure above its limit (none: the series is within them)."""
    over = []
    total = int(limits.get("code_changed", 0))
    if report.code_changed > total:
        over.append(f"upstream code changed by {report.code_changed} lines, limit {total}")
    neg = int(limits.get("negative_ids_changed", 0))
    if report.exception_changed > neg:
        over.append(f"negative expert ids: {report.exception_changed} lines, limit {neg}")
    block = int(limits.get("largest_block", 0))
    per_file = limits.get("files", {}) or {}
    for f in report.code_files():
        if f.largest_block > block:
            over.append(f"{f.path}: a block of {f.largest_block} code lines at line {f.largest_block_at}, limit {block}")
        if f.path not in per_file:
            over.append(f"{f.path}: changed by the series, not listed in {LIMITS_FILE}")
        elif f.changed > int(per_file[f.path]):
            over.append(f"{f.path}: {f.changed} lines changed, limit {per_file[f.path]}")
    return over


def report_text(report: SeriesReport, limits: dict[str, Any] | None = None) -> str:
    from moeplug.core.output import table

    rows = []
    for f in report.files:
        block = str(f.largest_block) if f.kind == "code" else "-"
        neg = str(f.exception_changed) if f.exception_changed else ""
        flag = "logic" if f.kind == "code" and f.largest_block > int((limits or {}).get("largest_block", 15)) else ""
        rows.append([f.path, f.kind, f"+{f.added}", f"-{f.removed}", neg, block, flag, str(len(f.patches))])
    text = table(["file", "kind", "added", "removed", "neg. ids", "largest block", "", "patches"], rows, "llrrrrlr")
    code = report.code_files()
    top = report.largest_block
    text += (f"\n{report.n_patches} patches on {report.tag}; upstream code (tests and CMake aside): "
             f"{len(code)} files, +{sum(f.added for f in code)} -{sum(f.removed for f in code)} = {report.code_changed} lines, "
             f"{report.exception_changed} of them the negative expert ids")
    if top is not None:
        text += f"\nlargest block outside the negative ids: {top.largest_block} code lines ({top.path}:{top.largest_block_at})"
    if limits is not None:
        over = check_limits(report, limits)
        text += "\n" + ("\n".join(f"over the limit: {line}" for line in over) if over else
                        f"within {LIMITS_FILE} (upstream code {limits.get('code_changed')}, "
                        f"largest block {limits.get('largest_block')})")
    return text
