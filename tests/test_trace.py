"""Routing traces: `moeplug trace convert/info` and `moeplug profile --from-trace`.

The traces are small npz files of the shared trace's layout (experts uint8 [tokens, layers, used],
probs float16, offsets int64) written here, so the tests do not depend on shared/; the real
gpt-oss-20b trace is read too where the clone sits beside shared/.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from helpers import run_cli, write_npz
from moeplug.profile.format import model_fingerprint, read_profile
from moeplug.model.synth import ModelSpec, make_model
from moeplug.profile.trace import load_trace, read_replay

LAYERS, EXPERTS, USED = 24, 32, 4  # gpt-oss-20b's routing layout
REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "gpt-oss-20b" / "decode-routing-mmlu.npz"


def numpy_counts(experts: np.ndarray, n_expert: int) -> np.ndarray:
    return np.stack([np.bincount(experts[:, layer].ravel(), minlength=n_expert) for layer in range(experts.shape[1])])


@pytest.fixture(scope="module")
def trace_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gpt-oss model of the trace's layout."""
    spec = ModelSpec(arch="gpt-oss", layers=LAYERS, experts=EXPERTS, used=USED, embd=64, expert_ff=64, heads=4,
                     heads_kv=2, head_dim=16, dtype="f32", seed=5)
    return make_model(spec, tmp_path_factory.mktemp("trace-model") / "goss-tiny.gguf")[0]


def test_convert_writes_the_documented_replay_file(tmp_path: Path) -> None:
    arrays = write_npz(tmp_path / "t.npz")
    out = tmp_path / "r.gguf"
    r = run_cli("trace", "convert", str(tmp_path / "t.npz"), str(out), "--prompts", "2:9", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    lo, hi = int(arrays["offsets"][2]), int(arrays["offsets"][9])
    assert (doc["n_prompts"], doc["n_tokens"], doc["weights"]) == (7, hi - lo, True)

    reader = gguf.GGUFReader(out)  # read with gguf-py alone, as the format document says
    fields = {k: reader.get_field(k) for k in ("general.type", "moe_replay.version", "moe_replay.n_layer",
                                                "moe_replay.n_expert", "moe_replay.n_expert_used",
                                                "moe_replay.n_prompts", "moe_replay.n_tokens")}
    assert fields["general.type"].contents() == "moe-route-replay"
    for k in list(fields)[1:]:
        assert fields[k].types == [gguf.GGUFValueType.UINT32], k
    assert [fields[k].contents() for k in list(fields)[1:]] == [1, LAYERS, EXPERTS, USED, 7, hi - lo]
    t = {x.name: x for x in reader.tensors}
    assert t["replay.experts"].tensor_type == gguf.GGMLQuantizationType.I32
    assert [int(x) for x in t["replay.experts"].shape] == [USED, LAYERS, hi - lo]
    assert t["replay.weights"].tensor_type == gguf.GGMLQuantizationType.F32
    assert t["replay.offsets"].tensor_type == gguf.GGMLQuantizationType.I32
    np.testing.assert_array_equal(np.asarray(t["replay.experts"].data).reshape(hi - lo, LAYERS, USED),
                                  arrays["experts"][lo:hi])
    np.testing.assert_array_equal(np.asarray(t["replay.weights"].data).reshape(hi - lo, LAYERS, USED),
                                  arrays["probs"][lo:hi].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(t["replay.offsets"].data), arrays["offsets"][2:10] - lo)

    no_w = tmp_path / "nw.gguf"
    assert run_cli("trace", "convert", str(tmp_path / "t.npz"), str(no_w), "--no-weights").returncode == 0
    assert read_replay(no_w).weights is None


def test_trace_info_counts_equal_numpys(tmp_path: Path) -> None:
    arrays = write_npz(tmp_path / "t.npz")
    out = tmp_path / "r.gguf"
    assert run_cli("trace", "convert", str(tmp_path / "t.npz"), str(out)).returncode == 0
    lo, hi = int(arrays["offsets"][-4]), int(arrays["offsets"][-1])
    for source in (tmp_path / "t.npz", out):  # both containers, python-slice ranges with a negative start
        r = run_cli("trace", "info", str(source), "--prompts=-3:", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["n_prompts"] == 3
        np.testing.assert_array_equal(np.array(doc["counts"]), numpy_counts(arrays["experts"][lo:hi], EXPERTS))
    r = run_cli("trace", "info", str(out))
    assert r.returncode == 0 and "24 layers x 4 of 32 experts" in r.stdout, r.stdout


def test_profile_from_trace_round_trip(tmp_path: Path, trace_model: Path) -> None:
    """npz -> profile and npz -> replay -> profile: counts equal numpy's on the same prompts, the
    sequences keep prompt and position, and the planner takes the profile."""
    arrays = write_npz(tmp_path / "t.npz")
    replay = tmp_path / "r.gguf"
    assert run_cli("trace", "convert", str(tmp_path / "t.npz"), str(replay), "--prompts", "0:8").returncode == 0
    lo, hi = int(arrays["offsets"][3]), int(arrays["offsets"][8])
    expected = numpy_counts(arrays["experts"][lo:hi], EXPERTS)
    for source in (tmp_path / "t.npz", replay):
        dest = tmp_path / f"{source.stem}.profile.gguf"
        r = run_cli("profile", "--from-trace", str(source), "--model", str(trace_model), "--prompts", "3:8",
                    "--out", str(dest), "--json")
        assert r.returncode == 0, r.stderr
        p = read_profile(dest)
        p.check_model(model_fingerprint(trace_model))
        np.testing.assert_array_equal(p.counts_decode, expected)
        assert p.counts_prefill.sum() == 0 and p.tokens(0) == 0 and p.tokens(1) == hi - lo
        assert p.tensors == [f"blk.{i}.ffn_down_exps.weight" for i in range(LAYERS)]
        (src,) = p.sources
        np.testing.assert_array_equal(src.seq, arrays["experts"][lo:hi])
        lengths = np.diff(arrays["offsets"][3:9])
        np.testing.assert_array_equal(src.meta[:, 0], np.repeat(np.arange(5), lengths))
        np.testing.assert_array_equal(src.meta[:, 1], np.concatenate([np.arange(n) for n in lengths]))
        assert (src.meta[:, 2] == 1).all()

    r = run_cli("plan", str(trace_model), "--profile", str(dest), "--vram-budget", "1GiB", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["predicted_hit_rate"] is not None and len(plan["slots_per_layer"]) == LAYERS


def test_from_trace_refuses_another_layout(tmp_path: Path, trace_model: Path) -> None:
    write_npz(tmp_path / "t.npz", layers=6, experts=16, used=2)
    out = tmp_path / "p.gguf"
    r = run_cli("profile", "--from-trace", str(tmp_path / "t.npz"), "--model", str(trace_model), "--out", str(out))
    assert r.returncode == 1 and not out.exists()
    assert r.stderr.count("\n") == 1 and "MoE layers 24 vs 6" in r.stderr and "experts 32 vs 16" in r.stderr \
        and "experts per token 4 vs 2" in r.stderr, r.stderr
    r = run_cli("profile", "--from-trace", str(tmp_path / "t.npz"))
    assert r.returncode == 2 and "--model" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def _bad_npz(tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"{case}.npz"
    if case == "not-npz":
        path.write_text("experts,probs,offsets\n")
    elif case == "missing-offsets":
        np.savez(path, experts=np.zeros((4, 2, 2), np.uint8))
    elif case == "offsets-not-increasing":
        write_npz(path, prompts=4, layers=2, experts=4, used=2, offsets=np.array([0, 10, 10, 20, 30], np.int64))
    elif case == "offsets-short":
        arrays = write_npz(path, prompts=4, layers=2, experts=4, used=2)
        write_npz(path, prompts=4, layers=2, experts=4, used=2, offsets=arrays["offsets"] - 1)
    elif case == "experts-2d":
        np.savez(path, experts=np.zeros((4, 2), np.uint8), offsets=np.array([0, 4]))
    elif case == "float-ids":
        np.savez(path, experts=np.zeros((4, 2, 2), np.float32), offsets=np.array([0, 4]))
    return path


NPZ_CASES = {
    "not-npz": "neither an npz trace nor a route replay file",
    "missing-offsets": "no offsets array",
    "offsets-not-increasing": "offsets are not strictly increasing",
    "offsets-short": "offsets[0] is -1",
    "experts-2d": "expected [tokens, layers, used]",
    "float-ids": "experts has dtype float32",
}


@pytest.mark.parametrize("case", list(NPZ_CASES))
def test_bad_npz_is_one_line(tmp_path: Path, case: str) -> None:
    src = _bad_npz(tmp_path, case)
    out = tmp_path / "out.gguf"
    r = run_cli("trace", "convert", str(src), str(out))
    assert r.returncode == 1 and not out.exists(), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and NPZ_CASES[case] in r.stderr, r.stderr


@pytest.mark.parametrize("spec,message", [("5:3", "selects no prompts"), ("x:y", "expected a range A:B"),
                                          ("0:4:2", "expected a range A:B"), ("12", "no prompt 12"),
                                          ("40:", "selects no prompts")])
def test_bad_prompt_range_is_one_line(tmp_path: Path, spec: str, message: str) -> None:
    write_npz(tmp_path / "t.npz")
    out = tmp_path / "out.gguf"
    r = run_cli("trace", "convert", str(tmp_path / "t.npz"), str(out), f"--prompts={spec}")
    assert r.returncode == 1 and not out.exists() and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def _rewrite(src: Path, dest: Path, **changes: object) -> Path:
    """The replay file src with some keys or tensors changed, written with gguf-py."""
    t = load_trace(src)
    w = gguf.GGUFWriter(dest, "moe-route-replay")
    keys = {"general.type": "moe-route-replay", "moe_replay.version": 1, "moe_replay.n_layer": t.n_layer,
            "moe_replay.n_expert": t.n_expert, "moe_replay.n_expert_used": t.n_expert_used,
            "moe_replay.n_prompts": t.n_prompts, "moe_replay.n_tokens": t.n_tokens}
    keys.update({k.replace("__", "."): v for k, v in changes.items() if not k.startswith("t_")})
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, int(v))
    w.add_tensor("replay.experts", changes.get("t_experts", t.experts.astype(np.int32)))  # type: ignore[arg-type]
    w.add_tensor("replay.offsets", changes.get("t_offsets", t.offsets.astype(np.int32)))  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _with_id(t, value: int) -> np.ndarray:
    ex = t.experts.copy()
    ex[3, 5, 1] = value
    return ex


# case -> (how the bad file is made from a good one and its trace, the message)
REPLAY_CASES = {
    "missing": (lambda good, t, bad: None, "no such trace file"),
    "truncated": (lambda good, t, bad: bad.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3]),
                  "truncated"),
    "not-replay": (lambda good, t, bad: _rewrite(good, bad, general__type="moe-profile"), "not a route replay file"),
    "version": (lambda good, t, bad: _rewrite(good, bad, moe_replay__version=2), "unsupported replay version 2"),
    "float-key": (lambda good, t, bad: _rewrite(good, bad, moe_replay__n_expert=32.0),
                  "moe_replay.n_expert is FLOAT32, expected UINT32"),
    "missing-key": (lambda good, t, bad: _rewrite(good, bad, moe_replay__n_tokens=None),
                    "missing key moe_replay.n_tokens"),
    "id-out-of-range": (lambda good, t, bad: _rewrite(good, bad, t_experts=_with_id(t, 32)),
                        "expert id 32 is out of range for 32 experts"),
    "offsets-end": (lambda good, t, bad: _rewrite(good, bad, t_offsets=t.offsets[:-1].astype(np.int32)),
                    "expected [13] from the keys"),
    "experts-type": (lambda good, t, bad: _rewrite(good, bad, t_experts=t.experts.astype(np.float32)),
                     "replay.experts is F32, expected I32"),
}


@pytest.mark.parametrize("case", list(REPLAY_CASES))
def test_bad_replay_file_is_one_line(tmp_path: Path, case: str) -> None:
    write_npz(tmp_path / "t.npz")
    good = tmp_path / "good.gguf"
    assert run_cli("trace", "convert", str(tmp_path / "t.npz"), str(good), "--no-weights").returncode == 0
    bad = tmp_path / f"{case}.gguf"
    make, message = REPLAY_CASES[case]
    make(good, load_trace(good), bad)
    out = tmp_path / "out.gguf"
    for argv in (["trace", "info", str(bad)], ["trace", "convert", str(bad), str(out)]):
        r = run_cli(*argv)
        assert r.returncode == 1 and not out.exists(), r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and message in r.stderr, r.stderr


def test_convert_never_replaces_without_force(tmp_path: Path) -> None:
    write_npz(tmp_path / "t.npz")
    out = tmp_path / "r.gguf"
    out.write_text("the user's file")
    r = run_cli("trace", "convert", str(tmp_path / "t.npz"), str(out))
    assert r.returncode == 1 and "--force" in r.stderr and out.read_text() == "the user's file"
    assert run_cli("trace", "convert", str(tmp_path / "t.npz"), str(out), "--force").returncode == 0
    assert read_replay(out).n_prompts == 12


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"no shared trace at {REAL_TRACE}")
def test_real_trace_split_by_prompt(tmp_path: Path) -> None:
    """The shared gpt-oss-20b trace: a held-out replay file and its counts, exactly numpy's."""
    out = tmp_path / "heldout.gguf"
    r = run_cli("trace", "convert", str(REAL_TRACE), str(out), "--prompts", "400:", "--json")
    assert r.returncode == 0, r.stderr
    with np.load(REAL_TRACE) as d:
        offsets, experts = d["offsets"], d["experts"]
    lo = int(offsets[400])
    t = read_replay(out)
    assert (t.n_prompts, t.n_tokens, t.n_layer, t.n_expert, t.n_expert_used) == (len(offsets) - 401, len(experts) - lo,
                                                                                 24, 32, 4)
    np.testing.assert_array_equal(t.counts(), numpy_counts(experts[lo:], 32))


@pytest.mark.native
def test_from_trace_profile_engages_the_cache(patched_build, trace_model: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server takes a --from-trace profile as the model's own: the cache engages with the
    trace's hottest experts."""
    from moeplug.serving.server import start_server
    from moeplug.serving.launch import parse_cache_line

    write_npz(tmp_path / "t.npz")
    profile = tmp_path / "p.gguf"
    assert run_cli("profile", "--from-trace", str(tmp_path / "t.npz"), "--model", str(trace_model),
                   "--out", str(profile)).returncode == 0
    monkeypatch.setenv("LLAMA_MOE_CACHE_DEVICE", "CPU")
    log = tmp_path / "server.log"
    with start_server(patched_build.binary("llama-server"), trace_model, log, ctx=512, threads=2,
                      extra_args=["--moe-cache-profile", str(profile), "--moe-cache-slots", "8"]) as srv:
        srv.wait_healthy(timeout=120)
        reply = srv.complete("hello", n_predict=4)
    cache = parse_cache_line(log.read_text(errors="replace"))
    assert cache and cache.engaged and (cache.layers, cache.slots) == (LAYERS, 8), log.read_text()[-2000:]
    assert len(reply["tokens"]) == 4


def test_from_trace_leaves_an_mtp_block_unrouted(tmp_path: Path) -> None:
    """A model with an MTP (NextN) block: the trace fills the trunk's MoE layers; the MTP row
    has zero counts and -1 (not routed) ids, as the profiler writes unrouted tokens."""
    spec = ModelSpec(arch="hy_v3", layers=4, experts=16, used=4, embd=64, expert_ff=64, heads=4, heads_kv=2,
                     head_dim=16, dtype="f32", mtp_layers=1)
    model = make_model(spec, tmp_path / "mtp.gguf")[0]
    arrays = write_npz(tmp_path / "t.npz", prompts=5, layers=3, experts=16, used=4)
    out = tmp_path / "p.gguf"
    r = run_cli("profile", "--from-trace", str(tmp_path / "t.npz"), "--model", str(model), "--out", str(out))
    assert r.returncode == 0, r.stderr
    p = read_profile(out)
    assert p.tensors == [f"blk.{b}.ffn_down_exps.weight" for b in (1, 2, 3, 4)]  # block 0 dense, block 4 MTP
    np.testing.assert_array_equal(p.counts_decode[:3], numpy_counts(arrays["experts"], 16))
    assert p.counts_decode[3].sum() == 0 and (p.sources[0].seq[:, 3] == -1).all()
