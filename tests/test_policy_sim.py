"""native/bench/policy_sim.py: the slot policies simulated on a trace whose held-out prompts use
experts the profile never saw."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native" / "bench"))
import policy_sim  # noqa: E402


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
