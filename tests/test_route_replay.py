"""Route replay in the engine (`--moe-route-replay`, native/REPLAY-FORMAT.md) on the CPU build:
the experts a served model computes are exactly the file's, the cache stays bitwise stock's
under replay, and a file that does not fit the model is refused with one line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers import make_profile
from moeplug.serving.metrics import parse_cache_counters
from moeplug.profile.format import read_profile
from moeplug.serving.server import start_server
from moeplug.model.synth import ModelSpec, make_model
from moeplug.profile.trace import Trace, write_replay

pytestmark = pytest.mark.native

# the gpt-oss-20b trace's layout (24 MoE layers, 32 experts, 4 used), at small widths
LAYOUT = dict(layers=24, experts=32, used=4)
N_PROMPTS = 3


def random_trace(seed: int = 3, lengths: tuple[int, ...] = (40, 57, 33), n_expert: int = 32,
                 layers: int = 24, used: int = 4) -> Trace:
    """Routing as a trained router gives it: a few experts hot per prompt, distinct per token."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        hot = rng.dirichlet(np.full(n_expert, 0.3), size=layers)  # per prompt and layer
        for _ in range(n):
            rows.append([rng.choice(n_expert, size=used, replace=False, p=hot[l]) for l in range(layers)])
    experts = np.asarray(rows, dtype=np.int32)
    weights = rng.random(experts.shape).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return Trace(experts=experts, offsets=offsets, n_expert=n_expert, weights=weights, source="test_route_replay")


@pytest.fixture(scope="session")
def replay_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(arch="gpt-oss", dtype="q8_0", seed=11, embd=64, expert_ff=64, heads=4, heads_kv=2, head_dim=16,
                     **LAYOUT)
    return make_model(spec, tmp_path_factory.mktemp("replay-model") / "gpt-oss-24x32.gguf")[0]


@pytest.fixture(scope="session")
def replay_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Trace]:
    trace = random_trace()
    out = tmp_path_factory.mktemp("replay") / "trace.replay.gguf"
    write_replay(trace, out)
    return out, trace


@pytest.fixture(scope="session")
def replay_profile(patched_build, replay_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_profile(patched_build, replay_model, tmp_path_factory.mktemp("replay-profile") / "profile.gguf", 8)


def slot_sets(profile: Path, n_slots: int) -> list[set[int]]:
    """The experts the cache keeps per layer: most decode selections, then prefill, then lower id."""
    p = read_profile(profile)
    out = []
    for layer in range(len(p.tensors)):
        dec, pre = p.counts_decode[layer], p.counts_prefill[layer]
        order = sorted(range(len(dec)), key=lambda e: (-int(dec[e]), -int(pre[e]), e))
        out.append(set(order[:n_slots]))
    return out


def test_served_model_computes_exactly_the_replayed_experts(patched_build, replay_model, replay_file, replay_profile,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests (two prompts of the file, the second shorter than its tokens: it wraps): the
    per-layer selections and slot hits on /metrics equal what numpy counts from the file's rows
    for the same positions and the slot set the profile gives."""
    import requests

    monkeypatch.setenv("LLAMA_MOE_CACHE_DEVICE", "CPU")
    path, trace = replay_file
    n_slots = 8
    args = ["--metrics", "--moe-route-replay", str(path), "--moe-cache-profile", str(replay_profile),
            "--moe-cache-slots", str(n_slots), "--moe-cache-max-batch", "512"]
    log = tmp_path / "server.log"
    prompt = list(range(100, 130))  # 30 token ids: one ubatch
    n_predict = 40  # prompt 1 has 57 rows: positions 0..68 wrap within it
    with start_server(patched_build.binary("llama-server"), replay_model, log, extra_args=args, ctx=512,
                      threads=2) as srv:
        srv.wait_healthy(timeout=180)
        # the start-up decodes (warm-up, context probe) are counted too, but replay no prompt of ours
        before = parse_cache_counters(requests.get(f"{srv.url}/metrics", timeout=10).text)
        replies = [srv.complete(prompt, n_predict=n_predict, ignore_eos=True) for _ in range(2)]
        counters = parse_cache_counters(requests.get(f"{srv.url}/metrics", timeout=10).text)
    text = log.read_text()
    assert "moe-replay: " + str(path) + ", 3 prompts, 130 tokens, 24 layers x 4 of 32, with weights" in text, text[-3000:]
    assert counters is not None

    slots = slot_sets(replay_profile, n_slots)
    layers = sorted(counters.layers)
    assert len(layers) == LAYOUT["layers"]
    expected_sel = np.zeros(len(layers), dtype=np.int64)
    expected_hit = np.zeros(len(layers), dtype=np.int64)
    for p, reply in enumerate(replies):  # request p replays prompt p (warm-up and probe forgotten)
        n_prompt, n_gen = reply["timings"]["prompt_n"], reply["timings"]["predicted_n"]
        assert (n_prompt, n_gen) == (len(prompt), n_predict)
        lo, hi = int(trace.offsets[p]), int(trace.offsets[p + 1])
        positions = np.arange(n_prompt + n_gen - 1)  # the last sampled token is never decoded
        rows = lo + positions % (hi - lo)
        for li in range(len(layers)):  # gpt-oss routes every row in its last layer too
            ids = trace.experts[rows, li, :]
            expected_sel[li] += ids.size
            expected_hit[li] += int(np.isin(ids, list(slots[li])).sum())
    assert before is not None
    got_sel = np.array([counters.layers[b]["selections"] - before.layers[b]["selections"] for b in layers])
    got_hit = np.array([counters.layers[b]["hits"] - before.layers[b]["hits"] for b in layers])
    assert got_sel.tolist() == expected_sel.tolist()
    assert got_hit.tolist() == expected_hit.tolist()


def test_cache_under_replay_is_bitwise_stock(patched_build, replay_model, replay_file, replay_profile) -> None:
    """test-moe-cache with the same replay on both sides: 100 prompt tokens in ubatches of 7 and 64
    greedy tokens, every logit equal with and without the cache."""
    path, _ = replay_file
    env = {**os.environ, "LLAMA_MOE_CACHE_DEVICE": "CPU"}
    for ubatch in (7, 64):
        r = subprocess.run([str(patched_build.binary("test-moe-cache")), "-m", str(replay_model), "--moe-cache-profile",
                            str(replay_profile), "--moe-cache-slots", "8", "--moe-cache-max-batch", "512",
                            "--moe-route-replay", str(path), "-ub", str(ubatch), "-n", "64", "-t", "2"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert r.stdout.strip().endswith("logits bitwise equal"), r.stdout
        assert "moe-replay: " in r.stderr


def test_replay_changes_what_the_model_computes(patched_build, replay_model, replay_file, tmp_path: Path) -> None:
    """The same request with and without the replay gives other tokens: the router's choice is
    really replaced (a replay the graph ignored would pass the counting test only by chance)."""
    path, _ = replay_file
    outs = []
    for name, extra in (("router", []), ("replay", ["--moe-route-replay", str(path)])):
        with start_server(patched_build.binary("llama-server"), replay_model, tmp_path / f"{name}.log",
                          extra_args=extra, ctx=256, threads=2) as srv:
            srv.wait_healthy(timeout=180)
            outs.append(srv.complete(list(range(100, 120)), n_predict=24, ignore_eos=True, n_probs=1))
    assert outs[0]["tokens"] != outs[1]["tokens"] or outs[0]["completion_probabilities"] != outs[1]["completion_probabilities"]


def bad_files(tmp_path: Path, good: Path, trace: Trace, profile: Path) -> dict[str, tuple[Path, str]]:
    other = random_trace(n_expert=16)
    other_path = tmp_path / "other-experts.gguf"
    write_replay(other, other_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "notes.txt"
    text.write_text("not a replay file\n")
    return {
        "other expert count": (other_path, "does not match the model: experts 16 in the file, 32 in the model"),
        "truncated": (truncated, "(missing, truncated or not GGUF)"),
        "not a replay file": (profile, "is not a moe route replay file"),
        "text": (text, "(missing, truncated or not GGUF)"),
        "missing": (tmp_path / "nowhere.gguf", "(missing, truncated or not GGUF)"),
    }


@pytest.mark.parametrize("case", ["other expert count", "truncated", "not a replay file", "text", "missing"])
def test_bad_replay_files_are_refused(patched_build, replay_model, replay_file, replay_profile, tmp_path: Path,
                                      case: str) -> None:
    """llama-server exits non-zero with one moe-replay: line naming the problem; nothing is served."""
    path, expect = bad_files(tmp_path, replay_file[0], replay_file[1], replay_profile)[case]
    r = subprocess.run([str(patched_build.binary("llama-server")), "-m", str(replay_model), "--moe-route-replay",
                        str(path), "--port", "0", "-t", "2", "-c", "256"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if "moe-replay:" in line]
    assert len(lines) == 1 and expect in lines[0], lines
    assert "server is listening" not in r.stdout + r.stderr


def test_llama_bench_replays_and_refuses(patched_build, replay_model, replay_file, tmp_path: Path) -> None:
    """llama-bench takes the flag: a run with the file, and a refusal for a file of another layout."""
    path, _ = replay_file
    bench = str(patched_build.binary("llama-bench"))
    ok = subprocess.run([bench, "-m", str(replay_model), "--moe-route-replay", str(path), "-p", "16", "-n", "4",
                         "-r", "1", "-t", "2", "-o", "json"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "moe-replay: " in ok.stderr
    other = tmp_path / "other.gguf"
    write_replay(random_trace(layers=12), other)
    bad = subprocess.run([bench, "-m", str(replay_model), "--moe-route-replay", str(other), "-p", "16", "-n", "0",
                          "-r", "1", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "MoE layers 12 in the file, 24 in the model" in bad.stderr, bad.stderr[-2000:]


def test_profiler_refuses_replay(patched_build, replay_model, replay_file, tmp_path: Path) -> None:
    prompts = Path(__file__).parents[1] / "profiles" / "codeish.txt"
    r = subprocess.run([str(patched_build.binary("llama-moe-profile")), "-m", str(replay_model), "--prompts",
                        str(prompts), "--out", str(tmp_path / "p.gguf"), "--moe-route-replay", str(replay_file[0])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--moe-route-replay" in r.stderr and not (tmp_path / "p.gguf").exists()
