"""Timing prompts through a running llama-server: each prompt's prefill and decode speed from the
server's own `timings`, as `moeplug bench` and `native/bench/serve_bench.py` measure them.

Three ways to send a workload. `time_prompts`: each prompt once with the tokens to decode, then
(optionally) once more with a short answer, then repeats of one token in passes over the prompts, so
that no prompt is timed right after itself (a dynamic slot policy would just have followed its
routing, and its prefill would look faster than a new prompt's); a prompt's prefill is the median of
its requests. The short answer's decode is the first tokens after a new prompt alone: the slots it
meets followed another prompt, and a long answer's decode hides how fast they follow. `time_chat`: each text a
conversation of a few turns, every turn sent after the last answer with the conversation so far
as its prompt and llama-server's prompt cache on, so a turn prefills its own text alone.
`time_together`: prompts in groups sent at once, as several users or agents sharing one server do;
llama-server, given as many parallel slots, prefills and decodes them in shared batches, and a
group's speed is the aggregate of its requests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeplug.core.errors import MoeplugError
from moeplug.serving.client import REQUEST_ERRORS, complete

CHAT_TURNS = 3  # turns a text is cut in for time_chat
SHORT_STEPS = 16  # decoding steps of time_prompts' short answers (n_predict one more: the first token is the prompt's)
ERRORS = (MoeplugError, *REQUEST_ERRORS, KeyError, ValueError, TypeError)


@dataclass
class Timed:
    """One prompt (or chat turn) in one server launch."""

    prefill: list[float]  # t/s of each request, the decoding one first
    decode: float  # t/s
    prompt_tokens: int  # what the server prefilled (prompt_n)
    context_tokens: int | None = None  # chat: the whole conversation up to this turn (tokens_evaluated)
    drafted: int = 0  # speculative decoding: tokens drafted and accepted
    accepted: int = 0
    decode_short: float | None = None  # t/s of a short answer's SHORT_STEPS steps, where time_prompts sent one

    @property
    def prefill_median(self) -> float:
        return statistics.median(self.prefill)


@dataclass
class Timings:
    """A workload's prompts in one launch: prompt index -> Timed; the requests in the order sent
    ("i:n_predict"); what failed."""

    prompts: dict[int, Timed] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def chat_turns(text: str, n: int = CHAT_TURNS) -> list[str]:
    """text cut in n turns of about equal length, each cut moved to the next space within 40
    characters where there is one (text without spaces, such as Chinese, is cut where it falls)."""
    cuts = [0]
    for k in range(1, n):
        at = len(text) * k // n
        space = text.find(" ", at, at + 40)
        cuts.append(max(cuts[-1] + 1, space if space >= 0 else at))
    return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]


def _timed(reply: dict[str, Any]) -> Timed:
    t = reply["timings"]
    return Timed([float(t["prompt_per_second"])], float(t["predicted_per_second"]), int(t["prompt_n"]),
                 drafted=int(t.get("draft_n", 0)), accepted=int(t.get("draft_n_accepted", 0)))


def short_steps(n_predict: int) -> int:
    """The decoding steps of time_prompts' short answers for a workload generating n_predict tokens:
    SHORT_STEPS where that is fewer than its own answers take, else 0 (none: its answers are short)."""
    return SHORT_STEPS if n_predict - 1 > SHORT_STEPS else 0


def time_prompts(url: str, prompts: Sequence[str | list[int]], n_predict: int, prefill_reps: int = 1,
                 short: int = 0) -> Timings:
    """Each prompt decoding n_predict tokens; then, where short > 0, a pass over the prompts answering
    each in short decoding steps (Timed.decode_short); then prefill_reps - 1 passes over the prompts
    with requests of one token (the prompts that answered the first time)."""
    out = Timings()
    for i, prompt in enumerate(prompts):
        out.sent.append(f"{i}:{n_predict}")
        try:
            out.prompts[i] = _timed(complete(url, prompt, n_predict, ignore_eos=True))
        except ERRORS as exc:
            out.errors.append(f"prompt {i}: {type(exc).__name__}: {exc}")
    for i in list(out.prompts) if short > 0 else []:
        out.sent.append(f"{i}:{short + 1}")
        try:
            out.prompts[i].decode_short = float(complete(url, prompts[i], short + 1, ignore_eos=True)["timings"]
                                                ["predicted_per_second"])
        except ERRORS as exc:
            out.errors.append(f"prompt {i}, short answer: {type(exc).__name__}: {exc}")
    for rep in range(1, prefill_reps):
        for i in list(out.prompts):
            out.sent.append(f"{i}:1")
            try:
                out.prompts[i].prefill.append(float(complete(url, prompts[i], 1)["timings"]["prompt_per_second"]))
            except ERRORS as exc:
                out.errors.append(f"prompt {i}, prefill repeat {rep}: {type(exc).__name__}: {exc}")
    return out


def opening_turn(i: int) -> bool:
    """Whether time_chat's prompt i is a conversation's first turn (a new conversation, prefilled in full)."""
    return i % CHAT_TURNS == 0


def time_chat(url: str, conversations: Sequence[Sequence[str]], n_predict: int) -> Timings:
    """Each conversation's turns in order (turn t of conversation c is prompt c * CHAT_TURNS + t): a
    turn's prompt is the conversation so far, the turns' text and the answers' token ids (llama-server
    takes such a mixed prompt), with the prompt cache on after the first turn. A failed turn ends its
    conversation."""
    out = Timings()
    for c, turns in enumerate(conversations):
        so_far: list[str | int] = []
        for t, text in enumerate(turns):
            i = c * CHAT_TURNS + t
            out.sent.append(f"{i}:{n_predict}")
            try:
                # the first turn prefills in full: llama-server keeps earlier prompts' states in RAM
                # (--cache-ram), and one whose text starts the same would stand in for its prefill
                reply = complete(url, [*so_far, text] if so_far else text, n_predict, ignore_eos=True,
                                 cache_prompt=bool(so_far))
                out.prompts[i] = _timed(reply)
                out.prompts[i].context_tokens = int(reply["tokens_evaluated"])
                so_far += [text, *(int(x) for x in reply["tokens"])]
            except ERRORS as exc:
                out.errors.append(f"conversation {c} turn {t}: {type(exc).__name__}: {exc}")
                break
    return out


def together_groups(prompts: Sequence[Any], streams: int) -> list[list[Any]]:
    """The prompts in groups of `streams` for time_together, in order, a last short group left out
    (the prompts cycled where there are fewer than one group's)."""
    if not prompts:
        return []
    if len(prompts) < streams:
        return [[prompts[i % len(prompts)] for i in range(streams)]]
    return [list(prompts[i:i + streams]) for i in range(0, len(prompts) - streams + 1, streams)]


def time_together(url: str, groups: Sequence[Sequence[str | list[int]]], n_predict: int) -> Timings:
    """Each group's prompts sent at once, a thread each, decoding n_predict tokens; the next group after
    the group's last answer. Group g is prompt g of the result, with the group's aggregate speed: its
    prompts' tokens over the longest prompt time (llama-server's timings), and its generated tokens
    over the wall time from sending the group to its last answer, prompts included (the requests share
    the server's batches, and one's prompt may be computed while another decodes: the wall time is
    what the group waited). A group with a failed request is left out, its errors kept."""
    out = Timings()
    for g, group in enumerate(groups):
        out.sent.append(f"{g}:{n_predict}x{len(group)}")
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            futures = [pool.submit(complete, url, prompt, n_predict, ignore_eos=True) for prompt in group]
        wall = time.monotonic() - started  # the pool waits for every answer before it closes
        timings, failed = [], False
        for k, fut in enumerate(futures):
            try:
                timings.append(fut.result()["timings"])
            except ERRORS as exc:
                out.errors.append(f"group {g} prompt {k}: {type(exc).__name__}: {exc}")
                failed = True
        if failed:
            continue
        try:
            prompt_n = sum(int(t["prompt_n"]) for t in timings)
            prompt_ms = max(float(t["prompt_ms"]) for t in timings)
            predicted_n = sum(int(t["predicted_n"]) for t in timings)
        except ERRORS as exc:
            out.errors.append(f"group {g}: {type(exc).__name__}: {exc}")
            continue
        if prompt_ms <= 0:
            out.errors.append(f"group {g}: llama-server timed its prompts at 0 ms")
            continue
        out.prompts[g] = Timed([1e3 * prompt_n / prompt_ms], predicted_n / wall, prompt_n)
    return out


def round_medians(runs: Sequence[Sequence[float]]) -> list[float]:
    """Round by round, the median over prompts of their t/s (runs: per prompt, its t/s in each round;
    a prompt without a round is left out of that round's median): how one server process as a whole
    ran, which each prompt's median over rounds hides. On the H200 one process could run 10-20% faster
    or slower than the next in all its prompts alike."""
    return [statistics.median([v[r] for v in runs if len(v) > r]) for r in range(max(map(len, runs), default=0))]


def median_ratio_interval(prompts: Sequence[tuple[Sequence[float], Sequence[float]]], draws: int = 2000,
                          seed: int = 0) -> list[float] | None:
    """The 95% interval of the median over prompts of mine / theirs, each the median of its rounds,
    when every prompt's rounds are drawn again with replacement on each side (a bootstrap over
    rounds). prompts: per prompt (my t/s per round, their t/s per round). Seeded: the same samples
    give the same interval. It shows what one run resolves, not what parts runs on other days or
    machines. None where a prompt has fewer than two rounds on a side, or there is no prompt."""
    if not prompts or any(len(a) < 2 or len(b) < 2 for a, b in prompts):
        return None
    rng = np.random.default_rng(seed)

    def redrawn(values: Sequence[float]) -> np.ndarray:
        x = np.asarray(values, dtype=np.float64)
        return np.median(x[rng.integers(0, len(x), (draws, len(x)))], axis=1)

    ratios = np.empty((draws, len(prompts)))
    for j, (mine, theirs) in enumerate(prompts):
        below = redrawn(theirs)
        ratios[:, j] = redrawn(mine) / np.where(below > 0, below, np.nan)
    medians = np.nanmedian(ratios, axis=1)
    medians = medians[~np.isnan(medians)]
    if not len(medians):
        return None
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return [float(lo), float(hi)]
