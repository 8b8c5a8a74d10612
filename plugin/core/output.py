"""Printing for people (tables, sizes, progress bars) and for scripts (--json): the CLI's one sink.

A command hands its result to `Output.result`: with --json the result's `to_json()` goes to
stdout, otherwise the command's text renderer's lines do. Library actions report progress
through a callback (moeplug.core.progress); `Output.progress` draws it on stderr, so stdout stays
the result alone.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from moeplug.core.errors import EXIT_OK
from moeplug.core.progress import Event, Note


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain text table; `align` has one 'l' or 'r' per column (default: numbers right)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if align is None:
        align = "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l" for i in range(len(headers)))

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def terminal_width() -> int | None:
    """The columns to fit text into: COLUMNS where set, else the terminal's where stdout is one;
    None for a pipe or a file (lines as long as they come, for whatever reads them)."""
    import os
    import shutil

    if not os.environ.get("COLUMNS") and not sys.stdout.isatty():
        return None
    return max(20, shutil.get_terminal_size((80, 24)).columns)


def wrap_lines(text: str, width: int | None, indent: str = "  ") -> str:
    """`text` in lines of at most `width` columns (None: as it is), broken at spaces, the lines
    after the first indented."""
    import textwrap

    if width is None or len(text) <= width:
        return text
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False,
                                   break_long_words=True))


def shell_lines(prefix: str, words: Sequence[str], width: int | None, indent: str = "    ") -> str:
    """`prefix` and a quoted command line, continued with ' \\' past `width` columns (None: one line):
    still one command when pasted into a shell."""
    import shlex

    quoted = [shlex.quote(w) for w in words]
    if width is None or len(prefix) + len(" ".join(quoted)) <= width:
        return prefix + " ".join(quoted)
    lines, line = [], prefix
    for w in quoted:
        if line.strip() and line not in (prefix, indent) and len(line) + 1 + len(w) + 2 > width:
            lines.append(line + " \\")
            line = indent
        line += ("" if line in (prefix, indent) else " ") + w
    return "\n".join([*lines, line])


def fitted_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None) -> str:
    """A table of labels and values (two columns) in `width` columns: values left-aligned beside the
    labels, each wrapped at spaces under its own column where it is too long; on a terminal too
    narrow for that, each value on the lines below its label. width None: one line a row."""
    import textwrap

    cells = [[str(c) for c in row] for row in rows]
    label_w = max([len(headers[0])] + [len(r[0]) for r in cells])
    value_w = max([len(headers[1])] + [len(r[1]) for r in cells])
    if width is None or label_w + 2 + value_w <= width:
        return table(headers, cells, "ll")
    room = width - label_w - 2
    stacked = room < 24
    lines = [f"{headers[0].ljust(label_w)}  {headers[1]}".rstrip(), "-" * min(width, label_w + 2 + min(value_w, room))]
    for label, value in cells:
        if stacked:
            lines.append(label)
            lines += textwrap.wrap(value, width, initial_indent="  ", subsequent_indent="  ") or [""]
            continue
        parts = textwrap.wrap(value, room, break_on_hyphens=False) or [""]
        lines.append(f"{label.ljust(label_w)}  {parts[0]}")
        lines += [" " * (label_w + 2) + part for part in parts[1:]]
    return "\n".join(line.rstrip() for line in lines)


class ProgressBar:
    """Progress on stderr: a bar on a terminal; elsewhere a line every `every` percent (0: none).

    The bar starts at the first update, when the total is known.
    """

    def __init__(self, description: str, unit: str = "it", every: int = 0) -> None:
        self.description, self.unit, self.every = description, unit, every
        self._bar: Any = None
        self._last_pct = -1

    def update(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=self.description, unit=self.unit, leave=False,
                                 unit_scale=self.unit == "B", unit_divisor=1024)
            self._bar.update(done - self._bar.n)
        elif self.every and total:
            pct = done * 100 // total
            if pct >= self._last_pct + self.every:
                note(f"  {self.description}: {pct}%")
                self._last_pct = pct

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def note(message: str) -> None:
    """A progress note for people, on stderr so that --json output stays clean; whatever stdout holds
    goes out first, so that a terminal or a log of both streams shows them in the order they came."""
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)


class Output:
    """Where a command's result and its progress go."""

    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        self._bars: dict[str, ProgressBar] = {}

    @classmethod
    def for_args(cls, args: Any) -> Output:
        return cls(bool(getattr(args, "json", False)))

    def progress(self, event: Event) -> None:
        """A moeplug.core.progress callback: notes as lines, steps as one bar per task, on stderr."""
        if isinstance(event, Note):
            self.close()
            note(event.text)
            return
        bar = self._bars.get(event.task)
        if bar is None:
            bar = self._bars[event.task] = ProgressBar(event.task, event.unit, every=event.every)
        bar.update(event.done, event.total)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()

    def result(self, result: Any, text: Callable[[Any], str | None]) -> int:
        """Print the result (JSON, or text(result) for people) and return its exit code."""
        self.close()
        if self.json_mode:
            print_json(to_json(result))
        else:
            lines = text(result)
            if lines:
                print(lines, flush=True)  # before any later note on stderr
        return int(getattr(result, "exit_code", EXIT_OK))


def to_json(result: Any) -> Any:
    """A result as JSON data: its to_json(), a dataclass's fields, or the value itself."""
    if hasattr(result, "to_json"):
        return result.to_json()
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    return result
