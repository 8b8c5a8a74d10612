"""native/bench/spec_curve.py: the expected-rate arithmetic, and the whole script on the CPU build
(a smoke test of the GPU benchmark: real llama-bench runs with replayed routing, slots in RAM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_npz
from moeplug.model.synth import ModelSpec, make_model

BENCH = Path(__file__).resolve().parents[1] / "native" / "bench"
sys.path.insert(0, str(BENCH))
import spec_curve  # noqa: E402


def test_expected_tokens_per_step() -> None:
    """1 + a + ... + a^n: no draft gives one token a step, a sure draft n + 1."""
    assert spec_curve.expected_tokens(0.7, 0) == pytest.approx(1.0)
    assert spec_curve.expected_tokens(0.7, 3) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert spec_curve.expected_tokens(1.0, 3) == 4.0
    assert spec_curve.expected_tokens(0.0, 5) == pytest.approx(1.0)


def test_best_draft_length_follows_the_batch_cost() -> None:
    """Batches that cost what one token costs reward the longest draft; batches whose cost grows
    with every token (each token's experts read from RAM) reward short ones or none."""
    flat = {k: 0.010 for k in range(1, 10)}
    steep = {k: 0.010 * k for k in range(1, 10)}
    assert spec_curve.best_draft(flat, 0.7, 0.0)[0] == 8
    n, rate = spec_curve.best_draft(steep, 0.7, 0.0)
    assert n == 1 and rate == pytest.approx(1.7 / 0.020)
    assert spec_curve.spec_tokens_per_s(flat, 0.7, 3, 0.001) == pytest.approx(spec_curve.expected_tokens(0.7, 3) / 0.013)
    assert spec_curve.spec_tokens_per_s(flat, 0.7, 12, 0.0) is None  # k = 13 not measured


def test_parse_ks() -> None:
    assert spec_curve.parse_ks("1-4,8") == [1, 2, 3, 4, 8]
    for bad in ("0-3", "4-2", "x", "", "1-100"):
        with pytest.raises(ValueError):
            spec_curve.parse_ks(bad)


@pytest.mark.native
def test_spec_curve_on_the_cpu_build(patched_build, tmp_path: Path) -> None:
    """The tables and the JSON agree: every expected rate is E(a, n) over the measured time of
    the batch of n + 1 tokens, and each side's draft length is the best of 1-8; a moeplug row per
    stream share, each against the one stock row."""
    spec = ModelSpec(arch="gpt-oss", layers=24, experts=32, used=4, embd=64, expert_ff=64, heads=4, heads_kv=2,
                     head_dim=16, dtype="f16", expert_dtype="mxfp4", seed=11)
    model = make_model(spec, tmp_path / "goss.gguf")[0]
    write_npz(tmp_path / "trace.npz", prompts=12)
    out = tmp_path / "curve.json"
    cmd = [sys.executable, str(BENCH / "spec_curve.py"), "--model", str(model), "--budgets", "25%", "--ks", "1-4",
           "--depths", "0,64", "--reps", "2", "--rounds", "1", "-t", "2", "--trace", str(tmp_path / "trace.npz"),
           "--train-prompts", "0:8", "--replay-prompts", "8:", "--draft-ms", "0.5", "--stream-shares", "0,0.5",
           "--row-env", "GGML_SCHED_HOST_OVERLAP=0",
           "--prebuilt-moeplug", str(patched_build.binary("llama-bench").parent), "--json", str(out)]
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "### time of one verification batch (ms)" in r.stdout
    assert "### expected decode with speculation (draft cost 0.50 ms per token)" in r.stdout
    doc = json.loads(out.read_text())
    assert all(c["moeplug"].endswith(", GGML_SCHED_HOST_OVERLAP=0") for c in doc["curve"])
    assert sorted((c["moeplug"].split(", ")[2], c["depth"], len(c["moeplug_ms"]), len(c["stock_ms"]))
                  for c in doc["curve"]) == [("stream 0", 0, 4, 4), ("stream 0", 64, 4, 4),
                                             ("stream 0.5", 0, 4, 4), ("stream 0.5", 64, 4, 4)]
    assert [r["env"].get("LLAMA_MOE_CACHE_STREAM") for r in doc["rows"]] == ["0", "0.5", None]
    assert [r["env"].get("GGML_SCHED_HOST_OVERLAP") for r in doc["rows"]] == ["0", "0", None]  # --row-env: moeplug's
    rows = doc["speculation"]
    assert len(rows) == 4 * len(spec_curve.ACCEPTANCE)
    for row in rows:
        curve = next(c for c in doc["curve"] if c["depth"] == row["depth"] and c["moeplug"] == row["moeplug"])
        for side, n_key, tps_key in (("moeplug_ms", "moeplug_spec_n", "moeplug_spec_tps"),
                                     ("stock_ms", "stock_spec_n", "stock_spec_tps")):
            ms = {int(k): v for k, v in curve[side].items()}
            rates = {n: spec_curve.expected_tokens(row["acceptance"], n) / ((ms[n + 1] + 0.5 * n) / 1e3)
                     for n in range(1, 4)}
            assert row[n_key] == max(rates, key=rates.get)
            assert row[tps_key] == pytest.approx(rates[row[n_key]])
        assert row["stock_tps"] == pytest.approx(1e3 / {int(k): v for k, v in curve["stock_ms"].items()}[1])
        line = f"| {row['acceptance']:.1f} | {row['stock_tps']:.1f} | {row['stock_spec_tps']:.1f} ({row['stock_spec_n']}) |"
        assert line in r.stdout
