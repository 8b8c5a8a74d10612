"""native/bench/policy_sim.py: the slot policies simulated on a trace whose held-out prompts use
experts the profile never saw."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native" / "bench"))
from helpers import write_npz  # noqa: E402
import policy_sim  # noqa: E402
from moeplug.planner.costs import DEFAULT_COSTS  # noqa: E402


def test_slots_that_follow_the_prompt_find_experts_the_profile_never_saw(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # 2 layers x 8 experts, 2 used: the 4 training prompts select experts 0 and 1, the 3 held-out
    # ones 6 and 7, 128 tokens each
    train = np.tile(np.array([0, 1], np.uint8), (4 * 20, 2, 1))
    held = np.tile(np.array([6, 7], np.uint8), (3 * 128, 2, 1))
    experts = np.concatenate([train, held])
    offsets = np.array([0, 20, 40, 60, 80, 208, 336, 464], np.int64)
    path = tmp_path / "trace.npz"
    np.savez_compressed(path, experts=experts, probs=np.ones(experts.shape, np.float16), offsets=offsets)
    assert policy_sim.main(["--trace", str(path), "--slots", "2", "--train", "4", "--requests", "3"]) == 0
    out = capsys.readouterr().out
    share = {name.strip(): (float(hit), float(ups), float(missed)) for name, hit, ups, missed in
             re.findall(r"^(.+?)\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    # the profile's experts are never used, and every prompt batch selects its two experts without a slot
    assert share["static (the profile's slots)"] == (0.0, 0.0, 2.0)
    # the engine's rule: the first request's prompt batch makes 6 and 7 hot, one swap per layer lands
    # per batch, so only the first decoded tokens of the first request miss; two swaps per layer in all;
    # the later requests' prompt batches find 6 and 7 resident (2 missed of 3 x 2 selected per layer)
    hit, swaps, missed = share["engine: margin 2, 8 uploads, one per layer"]
    assert 95.0 < hit < 100.0 and swaps == pytest.approx(4 / (3 * 64), abs=0.01)
    assert missed == pytest.approx(2 / 3, abs=0.01)
    assert share["LRU, every miss inserted at once"] == (100.0, 0.0, pytest.approx(2 / 3, abs=0.01))
    # the first prompt batch brought 6 and 7 into VRAM: kept in the slots from there, no upload ever
    assert share["engine, slots filled from the prompt batch"] == (100.0, 0.0, pytest.approx(2 / 3, abs=0.01))
    # the profile as a floor under the counts (half the seed): 6 and 7, used by every token, still beat it
    assert share["engine, the profile a floor (0.5)"] == (hit, swaps, missed)
    assert "3 requests, 2 of 8 slots per layer" in out


def _table(out: str) -> dict[tuple[str, str], tuple[float, float, float, list[float]]]:
    """The designs' table: (experts held, policy) -> hit %, uploads and CPU experts per token, ms per token
    at each bus speed."""
    rows = {}
    for held, name, hit, ups, cpu, ms in re.findall(r"^([\d.]+% \(\d+\))\s+(.+?)\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)"
                                                    r"\s+([\d. /]+) ms$", out, re.M):
        rows[(held, name)] = (float(hit), float(ups), float(cpu), [float(x) for x in ms.split(" / ")])
    return rows


def _crafted(path: Path) -> None:
    """1 of 8 experts used, 2 layers alike: 4 training prompts of expert 0 (20 tokens), then 2 held-out
    prompts of 128 tokens whose first 64 (the prompt batch) select expert 7; the first decodes expert
    1 (A) 64 times, the second cycles 2 (B), 3 (C), 1 (A) for 64 tokens."""
    a, b, c = 1, 2, 3
    decoded = [[a] * 64, ([b, c, a] * 22)[:64]]
    seq = [0] * 80 + [x for d in decoded for x in [7] * 64 + d]
    experts = np.repeat(np.array(seq, np.uint8)[:, None, None], 2, axis=1)
    np.savez_compressed(path, experts=experts, probs=np.ones(experts.shape, np.float16),
                        offsets=np.array([0, 20, 40, 60, 80, 208, 336], np.int64))


def test_the_frequency_classes_keep_a_hot_expert_that_lru_evicts(tmp_path: Path) -> None:
    """Two slots, A hot from the first request, then B, C, A in turn: plain LRU evicts the expert the
    next token wants every time (the second request misses all 64 tokens); upstream's classes keep A
    (64 decayed uses, class 5) over B and C (a use or a few, classes 0-4), so A hits all its 21 turns
    while B and C miss. The prompt batches (expert 7) only read the cache."""
    path = tmp_path / "trace.npz"
    _crafted(path)
    d = np.load(path)
    reqs = policy_sim.requests_of(d["experts"], d["offsets"], 4, 2)
    lru = policy_sim.upload_every_miss(reqs, 2, 8, 2, classed=False)
    classed = policy_sim.upload_every_miss(reqs, 2, 8, 2, classed=True)
    assert lru.hit == pytest.approx(63 / 128) and classed.hit == pytest.approx((63 + 21) / 128)
    # every miss uploaded: uploads per token are the misses per token (2 layers), none computed on the CPU
    for s in (lru, classed):
        assert s.uploads == pytest.approx(2 * (1 - s.hit)) and s.cpu == 0
    # the layers that waited on a read-back: each token with a miss, both layers
    assert lru.trips == pytest.approx(2 * 65 / 128) and classed.trips == pytest.approx(2 * 44 / 128)
    # four slots hold A, B and C: the same three first misses either way
    assert policy_sim.upload_every_miss(reqs, 2, 8, 4, classed=False).hit == pytest.approx(125 / 128)
    assert policy_sim.upload_every_miss(reqs, 2, 8, 4, classed=True).hit == pytest.approx(125 / 128)
    # a CPU share of misses once the cache is full: half of them stay on the CPU, out of the cache
    shared = policy_sim.upload_every_miss(reqs, 2, 8, 2, classed=True, cpu_share=0.5)
    assert shared.uploads + shared.cpu == pytest.approx(2 * (1 - shared.hit))
    assert shared.cpu == pytest.approx(shared.uploads - 2 * 2 / 128, abs=2 / 128)  # the two filling misses uploaded


def test_frequency_classes_are_doublings_of_decayed_uses() -> None:
    assert [policy_sim.frequency_class(u) for u in (0.5, 1, 1.99, 2, 4, 127.9, 128, 1e6)] == [0, 0, 0, 1, 2, 6, 7, 7]


def test_the_designs_table_prices_uploads_at_each_bus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a skewed random trace (4 layers, 2 of 16 used), the table at 12.5/25/50%: the designs that upload
    every miss upload what they miss, their time per token grows as the bus slows, the static slots' does
    not (no uploads), and every time is the cost model's of the counts printed beside it."""

    path = tmp_path / "trace.npz"
    n = len(write_npz(path, prompts=40, layers=4, experts=16, used=2)["experts"])
    assert n > 712
    write_npz(path, prompts=40, layers=4, experts=16, used=2,
              offsets=np.array([0, 100, 200, 328, 456, 584, 712], np.int64))
    assert policy_sim.main(["--trace", str(path), "--slots", "4", "--train", "2", "--requests", "4",
                            "--cpu-share", "0.5", "--expert-bytes", "1e7"]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert "the bus at 6 / 25 / 55 GB/s" in out and "experts of 10.00 MB" in out
    held = ("12.5% (2)", "25.0% (4)", "50.0% (8)")
    names = ("static (the profile's slots)", "moeplug's rule (misses on the CPU)", "LRU, every miss uploaded",
             "upstream's classes, every miss uploaded", "upstream's classes, CPU share 0.5")
    assert set(rows) == {(h, name) for h in held for name in names}
    for h in held:
        static = rows[(h, names[0])]
        assert static[1] == 0 and static[3][0] == static[3][1] == static[3][2]
        for name in names[2:4]:
            hit, ups, cpu, ms = rows[(h, name)]
            assert ups == pytest.approx(4 * 2 * (1 - hit / 100), abs=0.01) and cpu == 0
            assert ms[0] > ms[1] > ms[2]
            # uploads at 6 GB/s, the rest alike at every speed
            assert ms[0] - ms[2] == pytest.approx(1e3 * ups * 1e7 * (1 / 6e9 - 1 / 55e9), rel=0.01, abs=0.02)
        hit, ups, cpu, ms = rows[(h, names[4])]
        assert cpu > 0 and ups + cpu == pytest.approx(4 * 2 * (1 - hit / 100), abs=0.02)
        assert ups < rows[(h, names[3])][1]
        # the static slots: the misses on the CPU and at most a round trip per layer and token
        hit, _, cpu, ms = static
        assert cpu == pytest.approx(4 * 2 * (1 - hit / 100), abs=0.01)
        assert 1e3 * cpu * 1e7 / DEFAULT_COSTS.cpu_expert_bytes_per_s <= ms[0] <= 1e3 * (cpu * 1e7 / DEFAULT_COSTS.cpu_expert_bytes_per_s
                                                                          + 4 * (DEFAULT_COSTS.round_trip_s + 20e-6)) + 0.01
    # more slots, more hits, for every design
    for name in names:
        hits = [rows[(h, name)][0] for h in held]
        assert hits == sorted(hits), name
