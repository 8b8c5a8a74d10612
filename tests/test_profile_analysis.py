"""Profile analysis and file handling, checked against brute-force computations.

The synthetic routing traces go through a real profile file (write, read) before analysis.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from moeplug.profile import (
    ModelFingerprint,
    Profile,
    ProfileError,
    ProfileSource,
    analyze,
    default_slots,
    merge_profiles,
    read_profile,
    write_profile,
)

E, K, LAYERS = 16, 2, 3


def fingerprint(meta_hash: str = "0123456789abcdef") -> ModelFingerprint:
    names, shapes, types = [], [], []
    for b in range(LAYERS):
        for part, ne in (("gate", (64, 32, E, 1)), ("up", (64, 32, E, 1)), ("down", (32, 64, E, 1))):
            names.append(f"blk.{b}.ffn_{part}_exps.weight")
            shapes.append(ne)
            types.append(8)  # Q8_0
    return ModelFingerprint(arch="qwen3moe", n_layer=LAYERS, n_expert=E, n_expert_used=K, size=123456,
                            meta_hash=meta_hash, expert_tensors=tuple(names), expert_shapes=tuple(shapes),
                            expert_types=tuple(types))


def trace(kind: str, steps: int, seed: int) -> np.ndarray:
    """[steps, LAYERS, K] distinct ids per step: uniform, skewed (Zipf) or strongly local."""
    rng = np.random.default_rng(seed)
    out = np.zeros((steps, LAYERS, K), dtype=np.int16)
    for layer in range(LAYERS):
        weights = 1.0 / np.arange(1, E + 1) ** 1.2
        perm = rng.permutation(E)
        working = rng.choice(E, size=4, replace=False)
        for t in range(steps):
            if kind == "uniform":
                ids = rng.choice(E, size=K, replace=False)
            elif kind == "skewed":
                ids = perm[rng.choice(E, size=K, replace=False, p=weights / weights.sum())]
            else:  # local: a working set of 4 experts that drifts slowly
                if t % 25 == 0:
                    working[rng.integers(4)] = rng.choice(np.setdiff1d(np.arange(E), working))
                ids = rng.choice(working, size=K, replace=False)
            out[t, layer] = ids
    return out


def make_profile(kind: str, steps: int = 400, seed: int = 1, n_prefill: int = 20, label: str = "s",
                 gaps: bool = False) -> Profile:
    """gaps: the last layer does not route every 7th token (id -1), as an MTP head skips some."""
    prefill = trace("uniform", n_prefill, seed + 100)
    decode = trace(kind, steps, seed)
    if gaps:
        prefill[0, -1, :] = -1
        decode[::7, -1, :] = -1
    seq = np.concatenate([prefill, decode])
    meta = np.array([[0, i, 0] for i in range(n_prefill)] + [[0, n_prefill + i, 1] for i in range(steps)],
                    dtype=np.int32)
    def routed(ids: np.ndarray) -> np.ndarray:
        return ids[ids >= 0]

    counts = {ph: np.stack([np.bincount(routed(seq[meta[:, 2] == ph][:, layer].ravel()), minlength=E)
                            for layer in range(LAYERS)]).astype(np.int64) for ph in (0, 1)}
    return Profile(fingerprint=fingerprint(), tensors=[f"blk.{b}.ffn_down_exps.weight" for b in range(LAYERS)],
                   counts_prefill=counts[0], counts_decode=counts[1],
                   sources=[ProfileSource(label=label, prompt_labels=[label], seq=seq, meta=meta, n_predict=steps)])


# ---- brute force, one N at a time, the obvious way --------------------------------------------


def top_n(counts: list[int], n: int) -> set[int]:
    return set(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:n])


def brute_static(decode: np.ndarray, layer: int, n: int, hindsight: bool) -> int:
    half = len(decode) // 2
    pick_from = decode[half:] if hindsight else decode[:half]
    counts = [0] * E
    for step in pick_from:
        for e in step[layer]:
            if e >= 0:
                counts[e] += 1
    resident = top_n(counts, n)
    return sum(1 for step in decode[half:] for e in step[layer] if e in resident)


def brute_lru(decode: np.ndarray, layer: int, n: int) -> tuple[int, int]:
    half, cache, hits, uploads = len(decode) // 2, OrderedDict(), 0, 0
    for t, step in enumerate(decode):
        if step[layer][0] < 0:  # not routed: no hit, no upload, no update
            continue
        before = set(cache)
        for e in step[layer]:
            if t >= half:
                hits += e in before
                uploads += e not in before
        for e in step[layer]:
            if e in cache:
                cache.move_to_end(e)
            else:
                cache[e] = True
                if len(cache) > n:
                    cache.popitem(last=False)
    return hits, uploads


def brute_repick(decode: np.ndarray, layer: int, n: int, every: int) -> tuple[int, int]:
    half, resident, hits, uploads = len(decode) // 2, set(), 0, 0
    for t, step in enumerate(decode):
        if t % every == 0 and t > 0:
            counts = [0] * E
            for past in decode[t - every:t]:
                for e in past[layer]:
                    if e >= 0:
                        counts[e] += 1
            new = top_n(counts, n)
            if t >= half:
                uploads += len(new - resident)
            resident = new
        if t >= half:
            hits += sum(1 for e in step[layer] if e >= 0 and e in resident)
    return hits, uploads


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "local"])
def test_analysis_equals_brute_force(tmp_path: Path, kind: str, gaps: bool) -> None:
    profile = read_profile(write_profile(make_profile(kind, gaps=gaps), tmp_path / "p.gguf"))
    every = 32
    a = analyze(profile, repick_every=every)
    decode = profile.sources[0].phase_steps(1)
    half = len(decode) // 2
    for layer_index, layer in enumerate(a.layers):
        assert layer.selections == sum(1 for step in decode[half:] for e in step[layer_index] if e >= 0)
        for n in a.slots:
            assert layer.hits["static"][n] == brute_static(decode, layer_index, n, hindsight=False)
            assert layer.hits["oracle"][n] == brute_static(decode, layer_index, n, hindsight=True)
            assert (layer.hits["lru"][n], layer.uploads["lru"][n]) == brute_lru(decode, layer_index, n)
            assert (layer.hits[f"repick@{every}"][n], layer.uploads[f"repick@{every}"][n]) == \
                brute_repick(decode, layer_index, n, every)
        assert layer.hits["oracle"][E] == layer.selections  # every expert resident: every selection hits


def test_routing_kinds_behave_as_expected(tmp_path: Path) -> None:
    rates = {kind: analyze(make_profile(kind)) for kind in ("uniform", "skewed", "local")}
    n = 4  # a quarter of the experts
    uniform, skewed, local = (rates[k] for k in ("uniform", "skewed", "local"))
    assert uniform.overall_hit_rate("static", n) == pytest.approx(n / E, abs=0.08)
    assert skewed.overall_hit_rate("static", n) > uniform.overall_hit_rate("static", n) + 0.15
    assert local.overall_hit_rate("lru", n) > 0.8 > local.overall_hit_rate("static", n)
    for a in rates.values():
        assert a.overall_hit_rate("oracle", n) >= a.overall_hit_rate("static", n)


def test_json_document(tmp_path: Path) -> None:
    doc = analyze(make_profile("skewed"), slots=[2, 4, 16]).to_json()
    assert doc["tokens"] == {"prefill": 20, "decode": 400}
    assert doc["n_expert"] == E and doc["n_expert_used"] == K and doc["slots"] == [2, 4, 16]
    layer = doc["layers"][0]
    assert layer["tensor"] == "blk.0.ffn_down_exps.weight"
    assert len(layer["counts_decode"]) == E and sum(layer["counts_decode"]) == 400 * K
    assert set(layer["hit_rate"]) == {"static", "oracle", "lru", "repick@64"}
    assert layer["hit_rate"]["oracle"]["16"] == 1.0
    # one Q8_0 expert: gate 64x32 + up 64x32 + down 32x64 elements, 34 bytes per 32
    assert layer["bytes_per_expert"] == 3 * 64 * 32 // 32 * 34
    lru = layer["uploads_per_token"]["lru"]["2"]
    assert layer["upload_bytes_per_token"]["lru"]["2"] == pytest.approx(lru * layer["bytes_per_expert"])


def test_default_slots() -> None:
    assert default_slots(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert default_slots(8) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_merge_adds_counts_and_keeps_sources(tmp_path: Path) -> None:
    a, b, c = (make_profile(kind, seed=s, label=kind) for s, kind in enumerate(("uniform", "skewed", "local")))
    left = merge_profiles([merge_profiles([a, b]), c])
    right = merge_profiles([a, merge_profiles([b, c])])
    shuffled = merge_profiles([c, a, b])
    for m in (right, shuffled):
        assert np.array_equal(left.counts_decode, m.counts_decode)
        assert np.array_equal(left.counts_prefill, m.counts_prefill)
    assert np.array_equal(left.counts_decode, a.counts_decode + b.counts_decode + c.counts_decode)
    assert [s.label for s in left.sources] == ["uniform", "skewed", "local"]
    again = read_profile(write_profile(left, tmp_path / "m.gguf"))
    assert [s.label for s in again.sources] == ["uniform", "skewed", "local"]
    for s0, s1 in zip(left.sources, again.sources):
        assert np.array_equal(s0.seq, s1.seq) and np.array_equal(s0.meta, s1.meta)
    assert again.tokens(1) == 3 * 400


def test_merge_refuses_another_model() -> None:
    a = make_profile("uniform")
    b = make_profile("uniform")
    b.fingerprint = fingerprint(meta_hash="fedcba9876543210")
    with pytest.raises(ProfileError, match="another model: meta_hash"):
        merge_profiles([a, b])


def test_bad_profile_files(tmp_path: Path) -> None:
    good = write_profile(make_profile("uniform"), tmp_path / "good.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProfileError, match="truncated"):
        read_profile(cut)
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(data[:40])
    with pytest.raises(ProfileError, match="damaged or truncated"):
        read_profile(stub)
    future = tmp_path / "v7.gguf"
    future.write_bytes(data.replace(b"moe_profile.version\x04\x00\x00\x00\x01\x00\x00\x00",
                                    b"moe_profile.version\x04\x00\x00\x00\x07\x00\x00\x00"))
    with pytest.raises(ProfileError, match="unsupported profile version 7"):
        read_profile(future)
    with pytest.raises(ProfileError, match="no such profile"):
        read_profile(tmp_path / "absent.gguf")
