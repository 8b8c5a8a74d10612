"""llama-moe-profile on real synthetic models: counts, ids against stock, determinism, the CLI."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli
from moeplug.model.inspect import inspect_model
from moeplug.profile import model_fingerprint, read_profile

pytestmark = pytest.mark.native

PROMPTS = "The quick brown fox jumps over the lazy dog.\n---\ndef add(a, b):\n    return a + b\n"


def run_tool(build, model: Path, out: Path, prompts: str = PROMPTS, *extra: str) -> subprocess.CompletedProcess[str]:
    pfile = out.with_suffix(".txt")
    pfile.write_text(prompts)
    cmd = [str(build.binary("llama-moe-profile")), "-m", str(model), "--prompts", str(pfile), "--out", str(out),
           "-t", "2", "-c", "512", *extra]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("arch", ["qwen3moe", "hy_v3", "gpt-oss"])
def test_counts_sum_to_tokens_times_used(tmp_path: Path, patched_build, fixture_models, arch: str) -> None:
    model = fixture_models[arch]
    r = run_tool(patched_build, model, tmp_path / "p.gguf", PROMPTS, "-n", "12", "--ignore-eos")
    assert r.returncode == 0, r.stderr[-2000:]
    p = read_profile(tmp_path / "p.gguf")
    p.check_model(model_fingerprint(model))
    info = inspect_model(model)
    assert p.tensors == [f"blk.{b}.ffn_down_exps.weight" for b in info.moe_layers]
    n_prefill, n_decode = p.tokens(0), p.tokens(1)
    assert n_decode == 2 * 12 and n_prefill > 10
    k = info.n_expert_used
    assert (p.counts_prefill.sum(axis=1) == n_prefill * k).all()
    assert (p.counts_decode.sum(axis=1) == n_decode * k).all()
    seq = p.sources[0].seq
    for layer in range(len(p.tensors)):  # counts agree with the recorded sequences
        dec = p.sources[0].phase_steps(1)[:, layer, :].ravel()
        assert np.array_equal(np.bincount(dec, minlength=p.n_expert), p.counts_decode[layer])
        assert all(len(set(step)) == k for step in seq[:, layer, :].tolist())  # k distinct experts per token


def test_mtp_head_is_profiled(tmp_path: Path, patched_build, fixture_models) -> None:
    """The MTP block routes every token but each prompt's first; --no-mtp leaves it out."""
    model = fixture_models["hy_v3-mtp"]
    r = run_tool(patched_build, model, tmp_path / "p.gguf", PROMPTS, "-n", "10", "--ignore-eos")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "running the MTP head" in r.stderr
    p = read_profile(tmp_path / "p.gguf")
    p.check_model(model_fingerprint(model))
    assert p.tensors == [f"blk.{b}.ffn_down_exps.weight" for b in (1, 2, 3)]  # block 3 is the MTP block
    k, n_prompts = p.n_expert_used, 2
    assert (p.counts_prefill[:2].sum(axis=1) == p.tokens(0) * k).all()
    assert p.counts_prefill[2].sum() == (p.tokens(0) - n_prompts) * k
    assert (p.counts_decode.sum(axis=1) == 2 * 10 * k).all()
    src = p.sources[0]
    first = src.meta[:, 1] == 0
    assert (src.seq[first, 2, :] == -1).all() and (src.seq[~first, 2, :] >= 0).all()
    assert (src.seq[:, :2, :] >= 0).all()

    r = run_tool(patched_build, model, tmp_path / "trunk.gguf", PROMPTS, "-n", "10", "--ignore-eos", "--no-mtp")
    assert r.returncode == 0, r.stderr[-2000:]
    trunk = read_profile(tmp_path / "trunk.gguf")
    assert trunk.tensors == p.tensors[:2]
    assert np.array_equal(trunk.counts_decode, p.counts_decode[:2])  # the MTP head changes nothing upstream


def parse_topk_dump(text: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{block: (head rows, tail rows)} of every complete ffn_moe_topk dump in eval-callback's output.

    eval-callback prints at most 3 rows from each end of a tensor and "..." between them; with
    no elision the tail is empty and the head holds every row. A dump is complete once its
    "sum =" line is there.
    """
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"ffn_moe_topk-(\d+) = \(i32\)", line)
        if not m:
            continue
        head: list[list[int]] = []
        tail: list[list[int]] = []
        rows, complete = head, False
        for row in lines[i + 1:]:
            if "sum =" in row:
                complete = True
                break
            if row.strip().startswith("...,"):
                rows = tail
                continue
            vals = re.findall(r"-?\d+\.\d+", row)
            if vals:
                rows.append([int(float(v)) for v in vals])
        if complete and head:
            out[int(m[1])] = (np.array(head), np.array(tail).reshape(-1, len(head[0])))
    return out


def eval_callback_topk(build, model: Path, prompt: str, blocks: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Stock llama.cpp's own dump of the router's top-k tensor, for every MoE block.

    Stock eval-callback returns from main without draining its log thread, so the end of its
    output is sometimes lost (seen: 2 of 12 runs complete to the last line, 10 of 12 complete
    past the last MoE block). Run it again until every block's dump is there.
    """
    found: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _ in range(10):
        r = subprocess.run([str(build.binary("llama-eval-callback")), "-m", str(model), "-p", prompt, "-t", "2",
                            "-c", "512"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        found = parse_topk_dump(r.stdout + r.stderr)
        if sorted(found) == blocks:
            break
    return found


@pytest.mark.parametrize("prompt", ["Hello there", "Hello there, my friend, how are you today?"])
@pytest.mark.parametrize("arch", ["qwen3moe", "hy_v3", "gpt-oss"])
def test_ids_equal_stock_eval_callback(tmp_path: Path, patched_build, stock_build, fixture_models, arch: str,
                                      prompt: str) -> None:
    model = fixture_models[arch]
    r = run_tool(patched_build, model, tmp_path / "p.gguf", prompt, "-n", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    ours = read_profile(tmp_path / "p.gguf").sources[0].phase_steps(0)  # [T, layers, k]
    blocks = inspect_model(model).moe_layers
    stock = eval_callback_topk(stock_build, model, prompt, blocks)
    assert sorted(stock) == blocks
    for layer, block in enumerate(blocks):
        head, tail = stock[block]
        mine = ours[:, layer, :]
        if block == blocks[-1] and len(head) == 1 and not len(tail):
            mine = mine[-1:]  # stock computes the last block for the output token only; ours for every token
        assert np.array_equal(mine[:len(head)], head), f"block {block}, first tokens"
        if len(tail):
            assert np.array_equal(mine[-len(tail):], tail), f"block {block}, last tokens"
        else:
            assert len(head) == len(mine)


def test_same_seed_same_profile(tmp_path: Path, patched_build, fixture_models) -> None:
    model = fixture_models["qwen3moe"]
    files = {}
    for name, extra in (("greedy-a", ()), ("greedy-b", ()), ("s3-a", ("--temp", "1.0", "-s", "3")),
                        ("s3-b", ("--temp", "1.0", "-s", "3")), ("s4", ("--temp", "1.0", "-s", "4"))):
        r = run_tool(patched_build, model, tmp_path / f"{name}.gguf", PROMPTS, "-n", "16", "--ignore-eos",
                     "--label", "same", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        files[name] = (tmp_path / f"{name}.gguf").read_bytes()
    assert files["greedy-a"] == files["greedy-b"]
    assert files["s3-a"] == files["s3-b"]
    s3, s4 = read_profile(tmp_path / "s3-a.gguf"), read_profile(tmp_path / "s4.gguf")
    assert not np.array_equal(s3.sources[0].phase_steps(1), s4.sources[0].phase_steps(1))


def test_random_tokens_profile(tmp_path: Path, patched_build, fixture_models) -> None:
    """--random K:N: K prompts of N uniform token ids and random decode tokens (llama-bench's
    workload); seeded, so the same seed gives the same file."""
    tool, model = str(patched_build.binary("llama-moe-profile")), str(fixture_models["qwen3moe"])
    outs = []
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        out = tmp_path / f"{name}.gguf"
        r = subprocess.run([tool, "-m", model, "--random", "3:40", "-n", "8", "-s", seed, "--out", str(out), "-t", "2"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(out)
    p = read_profile(outs[0])
    assert p.sources[0].label == "random" and len(p.sources[0].prompt_labels) == 3
    assert (p.tokens(0), p.tokens(1)) == (3 * 40, 3 * 8)
    assert outs[0].read_bytes() == outs[1].read_bytes() != outs[2].read_bytes()
    r = subprocess.run([tool, "-m", model, "--random", "3"], capture_output=True, text=True)
    assert r.returncode == 1 and "--random 3: give K:N" in r.stderr


def test_tool_bad_input(tmp_path: Path, patched_build, fixture_models) -> None:
    tool = str(patched_build.binary("llama-moe-profile"))
    r = subprocess.run([tool, "-m", str(fixture_models["qwen3moe"])], capture_output=True, text=True)
    assert r.returncode == 1 and "--prompts FILE" in r.stdout + r.stderr
    r = subprocess.run([tool, "-m", str(fixture_models["qwen3moe"]), "--prompts", str(tmp_path / "none.txt")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "cannot open prompts file" in r.stderr
    assert not list(tmp_path.iterdir())


def test_cli_profile_end_to_end(tmp_path: Path, patched_build, fixture_models) -> None:
    model, out = fixture_models["hy_v3"], tmp_path / "hy.profile.gguf"
    r = run_cli("profile", str(model), "-n", "8", "--threads", "2", "--out", str(out), "--json", "--cpu",
                "--ignore-eos")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["profile"] == str(out)
    assert doc["tokens"]["decode"] == 8 * 16  # 8 codeish + 8 chatty bundled prompts
    assert [layer["tensor"] for layer in doc["layers"]] == ["blk.1.ffn_down_exps.weight", "blk.2.ffn_down_exps.weight"]
    profile = read_profile(out)
    assert [s.label for s in profile.sources] == ["codeish", "chatty"]
    r = run_cli("profile", "analyze", str(out), "--slots", "2,4,8")
    assert r.returncode == 0 and "hit rate of N resident slots" in r.stdout and "oracle" in r.stdout


def test_cli_profile_errors(tmp_path: Path, fixture_models) -> None:
    other = fixture_models["qwen3moe"]
    prof = tmp_path / "p.gguf"
    from test_profile_analysis import make_profile

    from moeplug.profile import write_profile

    write_profile(make_profile("uniform"), prof)
    r = run_cli("profile", "analyze", str(prof), "--model", str(other))
    assert r.returncode == 1 and "profile is of another model" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli("profile", str(other), "--prompts", "nosuchset")
    assert r.returncode == 1 and "unknown prompt set 'nosuchset'" in r.stderr
    r = run_cli("profile", "analyze", str(tmp_path / "none.gguf"))
    assert r.returncode == 1 and "no such profile file" in r.stderr
    r = run_cli("profile", "analyze", str(prof), "--slots", "a,b")
    assert r.returncode == 2


def test_profile_stored_by_fingerprint(tmp_path: Path, patched_build, fixture_models, monkeypatch) -> None:
    """Without --out the merged profile lands under the data dir, named by the model's fingerprint,
    written atomically (no temporary file left beside it)."""
    from moeplug.profile.runner import ProfileRun, default_profile_path, run_profile

    model = fixture_models["qwen3moe"]
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    run = ProfileRun(tool=patched_build.binary("llama-moe-profile"), model=model, n_predict=4, ctx=512, threads=2,
                     ignore_eos=True)
    dest, profile = run_profile(run, ["codeish"])
    fingerprint = model_fingerprint(model)
    assert dest == default_profile_path(fingerprint) == tmp_path / "data" / "moeplug" / "profiles" / \
        f"qwen3moe-{fingerprint.meta_hash}.gguf"
    assert read_profile(dest).tokens(1) == 8 * 4
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]
