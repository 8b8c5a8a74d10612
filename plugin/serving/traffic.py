"""What a served model's requests look like, from llama-server's own log: how long the prompts it
processed were and how many tokens it generated for them.

llama-server writes, for every request it finishes, a `print_timing` block (b11434,
tools/server/server-context.cpp, at the default verbosity):

    slot print_timing: id  0 | task 4 | prompt eval time =   7.16 ms /    32 tokens (...)
    slot print_timing: id  0 | task 4 |        eval time =   9.01 ms /    16 tokens (...)

The prompt tokens are those it computed, not those reused from its prompt cache: what a prompt
batch costs. moeplug starts every server with its log in a file of its own, emptied at each
launch (moeplug.serving.server.start_server), so the log holds the requests of the process that runs;
the first one is moeplug's own context probe (moeplug.serving.launch.launch_verified), whose end the
server record keeps (`traffic_from`, from probe_end) so that it is not counted.

From those requests `Traffic` gives the two numbers the planner weighs prompt batches with
(moeplug.planner.plan.make_plan): prompt tokens per generated token (`--prefill-weight`) and the length of
the prompts that carry most prompt tokens (`--prompt-tokens`: the token-weighted median, the
length at or above which half of all prompt tokens came). `moeplug reprofile` plans with them
(`learned_workload`) unless the user set them. Nothing here imports the planner or prints.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# the fewest finished requests a workload is learned from: fewer say little about the next ones
MIN_REQUESTS = 8
# learned values closer than this (a ratio) to the planned ones do not re-plan: a server is not
# restarted for a workload that moved a little
WORKLOAD_TOLERANCE = 1.25
MAX_PREFILL_WEIGHT = 1000.0  # the --prefill-weight range's top
# at or below llama.cpp's physical batch a prompt is one batch whatever the plan: no length to plan for
SHORT_PROMPT_TOKENS = 512

# a request's timings: slot id, task id, milliseconds, tokens (native/bench/timeline.py reads them too)
PROMPT_TIMING_RE = re.compile(r"print_timing: id +(\d+) \| task (\d+) \| prompt eval time = *([\d.]+) ms / *(\d+) tokens")
EVAL_TIMING_RE = re.compile(r"print_timing: id +(\d+) \| task (\d+) \| +eval time = *([\d.]+) ms / *(\d+) tokens")


@dataclass(frozen=True)
class Request:
    """One finished request: prompt tokens computed (not reused from the cache), tokens generated,
    and the milliseconds each phase took."""

    prompt_tokens: int
    generated_tokens: int
    prompt_ms: float
    generated_ms: float


def _finished(text: str) -> list[tuple[Request, int]]:
    """Each finished request of a log with the offset just past its block's `eval time` line."""
    pending: dict[tuple[str, str], tuple[int, float]] = {}
    done: list[tuple[Request, int]] = []
    offset = 0
    for line in text.splitlines(keepends=True):
        offset += len(line)
        m = PROMPT_TIMING_RE.search(line)
        if m:
            pending[(m[1], m[2])] = (int(m[4]), float(m[3]))
            continue
        m = EVAL_TIMING_RE.search(line)
        if m and (m[1], m[2]) in pending and line.endswith("\n"):
            tokens, ms = pending.pop((m[1], m[2]))
            done.append((Request(tokens, int(m[4]), ms, float(m[3])), offset))
    return done


def parse_requests(text: str) -> list[Request]:
    """The finished requests of a llama-server log, in the order they finished. A block cut off
    before its `eval time` line (the log read while the server writes it) is left out."""
    return [r for r, _ in _finished(text)]


def _read(log: str | Path, start: int = 0) -> str:
    """A log from byte `start` on, one character per byte (offsets are bytes)."""
    with open(log, "rb") as f:
        f.seek(start)
        return f.read().decode("latin-1")


def probe_end(log: str | Path, timeout: float = 5.0) -> int:
    """The byte offset just past the first finished request of a server's log (the launch's context
    probe), waiting up to `timeout` seconds for llama-server's logging thread to write it; the log's
    length when it does not show (a build that logs otherwise): nothing before counts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = _read(log)
        except OSError:
            return 0
        done = _finished(text)
        if done or time.monotonic() >= deadline:
            return done[0][1] if done else len(text)
        time.sleep(0.05)


def weighted_median(lengths: list[int]) -> int:
    """The length at or above which half of all tokens came: the median of the lengths, each
    counted once per token it has."""
    total = sum(lengths)
    if total <= 0:
        return 0
    seen = 0
    for n in sorted(lengths):
        seen += n
        if 2 * seen >= total:
            return n
    return max(lengths)  # not reached


@dataclass(frozen=True)
class Traffic:
    """A server's finished requests, summed."""

    requests: int
    prompt_tokens: int  # computed, not from the prompt cache
    generated_tokens: int
    prompt_seconds: float
    generated_seconds: float
    prompt_median: int  # token-weighted (weighted_median)
    prompt_max: int
    source: str = ""  # the log it was read from

    @classmethod
    def of(cls, requests: list[Request], source: str = "") -> Traffic:
        lengths = [r.prompt_tokens for r in requests]
        return cls(len(requests), sum(lengths), sum(r.generated_tokens for r in requests),
                   sum(r.prompt_ms for r in requests) / 1e3, sum(r.generated_ms for r in requests) / 1e3,
                   weighted_median(lengths), max(lengths, default=0), source)

    @property
    def prefill_weight(self) -> float:
        """Prompt tokens computed per token generated, within --prefill-weight's range."""
        if self.generated_tokens <= 0:
            return MAX_PREFILL_WEIGHT if self.prompt_tokens else 0.0
        return min(MAX_PREFILL_WEIGHT, self.prompt_tokens / self.generated_tokens)

    @property
    def planned_prompt_tokens(self) -> int | None:
        """The prompt length to plan prompt batches for; None where most prompt tokens come in
        prompts of one batch (the profile's own prompts then price them)."""
        return self.prompt_median if self.prompt_median > SHORT_PROMPT_TOKENS else None

    @property
    def prompt_tokens_per_s(self) -> float | None:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else None

    @property
    def generated_tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.generated_seconds if self.generated_seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"prefill_weight": self.prefill_weight,
                               "planned_prompt_tokens": self.planned_prompt_tokens,
                               "prompt_tokens_per_s": self.prompt_tokens_per_s,
                               "generated_tokens_per_s": self.generated_tokens_per_s}

    def summary(self) -> str:
        """One line for people."""
        return (f"{self.requests} requests, {self.prompt_tokens} prompt tokens computed (half of them in prompts of "
                f"{self.prompt_median} or more, the longest {self.prompt_max}), {self.generated_tokens} generated: "
                f"{self.prefill_weight:.3g} prompt tokens per generated token")


def read_traffic(log: str | Path, start: int = 0) -> Traffic | None:
    """The traffic a server's log holds from byte `start` on, or None when the log cannot be read."""
    return LogTraffic(log, start).read()


class LogTraffic:
    """The traffic of one server's log, read incrementally: each call parses only what the server
    wrote since the last one (a dashboard asks every second; a log grows by ~2 KB per request). A log
    that shrank or was replaced (the server launched again) is read from `start` anew."""

    def __init__(self, log: str | Path, start: int = 0) -> None:
        self.log, self.start = str(log), start
        self._inode: int | None = None
        self._upto = start  # the byte after the last finished request parsed
        self._requests: list[Request] = []

    def read(self) -> Traffic | None:
        try:
            st = Path(self.log).stat()
            if st.st_ino != self._inode or st.st_size < self._upto:
                self._inode, self._upto, self._requests = st.st_ino, self.start, []
            if st.st_size > self._upto:
                done = _finished(_read(self.log, self._upto))
                if done:
                    self._requests += [r for r, _ in done]
                    self._upto += done[-1][1]
        except OSError:
            return None
        return Traffic.of(self._requests, self.log)


def _far(a: float | None, b: float | None) -> bool:
    """Whether two planned values differ by more than WORKLOAD_TOLERANCE (None: not planned)."""
    if a is None or b is None:
        return (a is None) != (b is None)
    lo, hi = sorted((a, b))
    return hi > lo * WORKLOAD_TOLERANCE if lo > 0 else hi > 0


def learned_workload(traffic: Traffic | None, prefill_weight: float,
                     prompt_tokens: int | None) -> tuple[float, int | None] | None:
    """(prefill weight, prompt length) to plan for from the traffic, or None where it is too
    little (MIN_REQUESTS) or says what the plan already weighs, within WORKLOAD_TOLERANCE."""
    if traffic is None or traffic.requests < MIN_REQUESTS:
        return None
    weight, length = round(traffic.prefill_weight, 3), traffic.planned_prompt_tokens
    if not _far(weight, prefill_weight) and not _far(length, prompt_tokens):
        return None
    return weight, length
