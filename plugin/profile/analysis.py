"""How many routed-expert selections N resident slots per layer would serve.

Measured on generated (decode) tokens, where the slot cache works. Every source (a profiler run)
is split in time: its first half is history, its second half the test on which every policy is
scored, so the numbers compare:

- `static`:   the top-N experts by count over the history halves (a profile picked in advance)
- `oracle`:   the top-N experts by count over the test halves themselves (hindsight: the best
              any fixed set can do)
- `lru`:      N slots holding the most recently used experts, updated after every token
- `repick@K`: every K tokens, the top-N of the last K tokens (re-picking the set periodically)

A selection is a hit when its expert is resident before the token is processed; a token's
selections then update the dynamic policies. Top-N ties go to the lower expert id. Ids of -1
(a token a layer did not route, e.g. an MTP head and a prompt's first token) are skipped. Dynamic
policies also report uploads: experts copied into slots per test token (an LRU miss, or an
expert entering the set at a re-pick), and those uploads in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from moeplug.profile.format import PHASE_DECODE, Profile


def default_slots(n_expert: int) -> list[int]:
    powers = {1 << i for i in range(n_expert.bit_length()) if 1 << i <= n_expert}
    fractions = {n_expert * f // 8 for f in range(1, 9)}
    return sorted(n for n in powers | fractions if n > 0)


def rank_by_count(counts: np.ndarray) -> np.ndarray:
    """rank[e] = position of expert e when sorted by count (descending), ties by lower id."""
    order = np.lexsort((np.arange(counts.shape[-1]), -counts))
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank


@dataclass
class LayerAnalysis:
    tensor: str
    counts_decode: list[int]
    counts_prefill: list[int]
    bytes_per_expert: int
    hits: dict[str, dict[int, int]] = field(default_factory=dict)
    uploads: dict[str, dict[int, int]] = field(default_factory=dict)
    selections: int = 0  # test selections: test tokens x n_expert_used
    test_tokens: int = 0

    def hit_rate(self, policy: str, n: int) -> float | None:
        return self.hits[policy][n] / self.selections if self.selections else None

    def skew(self) -> dict[str, float]:
        c = np.asarray(self.counts_decode, dtype=np.float64)
        total = c.sum()
        if total == 0:
            return {"entropy_norm": 0.0, "top10pct_share": 0.0, "max_over_mean": 0.0}
        p = c[c > 0] / total
        top = np.sort(c)[::-1][: max(1, -(-len(c) // 10))]
        return {
            "entropy_norm": float(-(p * np.log(p)).sum() / np.log(len(c))) if len(c) > 1 else 1.0,
            "top10pct_share": float(top.sum() / total),
            "max_over_mean": float(c.max() / c.mean()),
        }


@dataclass
class Analysis:
    n_expert: int
    n_expert_used: int
    tokens_prefill: int
    tokens_decode: int
    slots: list[int]
    policies: list[str]
    repick_every: int
    layers: list[LayerAnalysis]

    def overall_hit_rate(self, policy: str, n: int) -> float | None:
        sel = sum(layer.selections for layer in self.layers)
        return sum(layer.hits[policy][n] for layer in self.layers) / sel if sel else None

    def to_json(self) -> dict[str, Any]:
        def per_n(fn: Any) -> dict[str, dict[str, Any]]:
            return {p: {str(n): fn(p, n) for n in self.slots} for p in self.policies}

        dynamic = [p for p in self.policies if p not in ("static", "oracle")]
        return {
            "tokens": {"prefill": self.tokens_prefill, "decode": self.tokens_decode},
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "slots": self.slots,
            "policies": self.policies,
            "repick_every": self.repick_every,
            "hit_rate": per_n(self.overall_hit_rate),
            "layers": [
                {
                    "tensor": layer.tensor,
                    "counts_decode": layer.counts_decode,
                    "counts_prefill": layer.counts_prefill,
                    "test_tokens": layer.test_tokens,
                    "hit_rate": per_n(layer.hit_rate),
                    "uploads_per_token": {p: {str(n): (layer.uploads[p][n] / layer.test_tokens if layer.test_tokens
                                                       else None) for n in self.slots} for p in dynamic},
                    "upload_bytes_per_token": {p: {str(n): (layer.uploads[p][n] * layer.bytes_per_expert /
                                                            layer.test_tokens if layer.test_tokens else None)
                                                   for n in self.slots} for p in dynamic},
                    "bytes_per_expert": layer.bytes_per_expert,
                    "skew": layer.skew(),
                }
                for layer in self.layers
            ],
        }


def _lru_distances(steps: np.ndarray, n_expert: int) -> np.ndarray:
    """Stack distance of every selection, for every layer at once.

    steps: [S, L, k] ids. Returns [S, L, k]: how many distinct experts were used since this
    expert's last use (n_expert + 1 if never; -1 where the id is -1, not routed). An N-slot LRU
    holds the selection iff 0 <= distance < N.
    """
    n_steps, n_layers, k = steps.shape
    last = np.full((n_layers, n_expert), -1, dtype=np.int64)
    out = np.empty(steps.shape, dtype=np.int64)
    rows = np.arange(n_layers)[:, None]
    for t in range(n_steps):
        ids = steps[t].astype(np.int64)  # [L, k]
        valid = ids >= 0
        safe = np.where(valid, ids, 0)
        mine = last[rows, safe]  # [L, k]
        dist = (last[:, None, :] > mine[:, :, None]).sum(axis=2)
        out[t] = np.where(~valid, -1, np.where(mine < 0, n_expert + 1, dist))
        last[rows, safe] = np.where(valid, t * k + np.arange(k), mine)
    return out


def _count_ranked_hits(ranks: np.ndarray, slots: list[int]) -> dict[int, int]:
    return {n: int((ranks < n).sum()) for n in slots}


def _bincount(ids: np.ndarray, n_expert: int) -> np.ndarray:
    ids = ids.ravel()
    return np.bincount(ids[ids >= 0], minlength=n_expert)


def analyze(profile: Profile, slots: list[int] | None = None, repick_every: int = 64) -> Analysis:
    n_expert, k = profile.n_expert, profile.n_expert_used
    slots = slots or default_slots(n_expert)
    repick = f"repick@{repick_every}"
    policies = ["static", "oracle", "lru", repick]
    n_layers = len(profile.tensors)

    decode = [s.phase_steps(PHASE_DECODE) for s in profile.sources]  # each [S, L, k]
    history = [d[: len(d) // 2] for d in decode]
    tests = [d[len(d) // 2:] for d in decode]

    def counts_of(chunks: list[np.ndarray]) -> np.ndarray:
        c = np.zeros((n_layers, n_expert), dtype=np.int64)
        for chunk in chunks:
            for layer in range(n_layers):
                c[layer] += _bincount(chunk[:, layer, :], n_expert)
        return c

    hist_counts, test_counts = counts_of(history), counts_of(tests)
    layers = [
        LayerAnalysis(
            tensor=name, counts_decode=[int(x) for x in profile.counts_decode[i]],
            counts_prefill=[int(x) for x in profile.counts_prefill[i]],
            bytes_per_expert=profile.fingerprint.bytes_per_expert(name), selections=int(test_counts[i].sum()),
            test_tokens=int(test_counts[i].sum()) // k,
            hits={p: {n: 0 for n in slots} for p in policies}, uploads={p: {n: 0 for n in slots} for p in policies},
        )
        for i, name in enumerate(profile.tensors)
    ]

    for i, layer in enumerate(layers):
        for policy, counts in (("static", hist_counts[i]), ("oracle", test_counts[i])):
            rank = rank_by_count(counts)
            sorted_test = test_counts[i][np.argsort(rank)]
            cum = np.concatenate([[0], np.cumsum(sorted_test)])
            layer.hits[policy] = {n: int(cum[min(n, n_expert)]) for n in slots}

    for d, h in zip(decode, history):
        if len(d) == len(h):
            continue
        dist = _lru_distances(d, n_expert)[len(h):]  # [T, L, k] for the test half
        for i, layer in enumerate(layers):
            routed = dist[:, i, :] >= 0
            for n in slots:
                hits = int((routed & (dist[:, i, :] < n)).sum())
                layer.hits["lru"][n] += hits
                layer.uploads["lru"][n] += int(routed.sum()) - hits
        _score_repick(d, len(h), repick_every, n_expert, slots, layers, repick)

    return Analysis(n_expert=n_expert, n_expert_used=k, tokens_prefill=profile.tokens(0),
                    tokens_decode=profile.tokens(PHASE_DECODE), slots=slots, policies=policies,
                    repick_every=repick_every, layers=layers)


def _score_repick(d: np.ndarray, test_start: int, every: int, n_expert: int, slots: list[int],
                  layers: list[LayerAnalysis], policy: str) -> None:
    """Re-pick the top-N of the last `every` tokens at steps 0, every, 2*every, ... (empty at 0)."""
    n_layers = d.shape[1]
    never = np.full(n_expert, n_expert + 1)  # rank of every expert before the first pick: none resident
    for i in range(n_layers):
        rank = never
        for start in range(0, len(d), every):
            if start > 0:
                new_rank = rank_by_count(_bincount(d[start - every:start, i, :], n_expert))
                if start >= test_start:
                    for n in slots:
                        layers[i].uploads[policy][n] += int(((new_rank < n) & (rank >= n)).sum())
                rank = new_rank
            lo = max(start, test_start)
            block = d[lo:start + every, i, :]
            block = block[block >= 0]
            if len(block):
                for n, hits in _count_ranked_hits(rank[block], slots).items():
                    layers[i].hits[policy][n] += hits
