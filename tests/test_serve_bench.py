"""native/bench/serve_bench.py end to end on the CPU builds (a smoke test of the GPU benchmark):
real stock and patched llama-servers, launched by moeplug's library, on a tiny gpt-oss model of
the trace's layout (24 layers x 4 of 32 experts, experts in MXFP4)."""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_npz
from moeplug.profile.runner import read_prompts
from moeplug.model.synth import ModelSpec, make_model

pytestmark = pytest.mark.native

SERVE_BENCH = Path(__file__).resolve().parents[1] / "native" / "bench" / "serve_bench.py"
sys.path.insert(0, str(SERVE_BENCH.parent))
import serve_bench  # noqa: E402
REPLAY_FLAG = "--moe-route-replay"


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(arch="gpt-oss", layers=24, experts=32, used=4, embd=64, expert_ff=64, heads=4, heads_kv=2,
                     head_dim=16, dtype="f16", expert_dtype="mxfp4", seed=11)
    return make_model(spec, tmp_path_factory.mktemp("serve-bench") / "goss-mxfp4.gguf")[0]


def run_bench(patched_build, stock_build, model: Path, tmp_path: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SERVE_BENCH), "--model", str(model), "--budgets", "25%", "--ctx", "1024", "-t", "2",
           "-n", "4", "--max-prompts", "2", "--random-prompts", "2", "--random-tokens", "16", "--profile-tokens", "4",
           "--rounds", "2", "--prebuilt-moeplug", str(patched_build.binary("llama-server").parent),
           "--prebuilt-stock", str(stock_build.binary("llama-server").parent), "--json", str(out), *extra]
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}  # server records and logs stay here
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout, json.loads(out.read_text())


def check_table(stdout: str, doc: dict, workload: str) -> None:
    """The markdown table has the budget's row with its ratios, and they are the per-prompt ratios
    of the recorded samples (median over rounds per prompt, then median and lowest over prompts)."""
    section = stdout.split(f"### {workload}:")[1].split("###")[0]
    rows = [line for line in section.splitlines() if line.startswith("| 25% (")]
    assert len(rows) == 1, section
    ratios = re.findall(r"([\d.]+)x \(lowest ([\d.]+)x\)", rows[0])
    assert len(ratios) == 2, rows[0]  # prefill and decode
    (row,) = doc["tables"][workload]
    mine, stock = (next(c for c in doc["configs"] if c["side"] == side and workload in c["workloads"])
                   for side in ("moeplug", "stock"))
    for test, key in ((0, "prefill"), (1, "decode")):
        per = [statistics.median(s[test] for s in mine["samples"][k]) /
               statistics.median(s[test] for s in stock["samples"][k])
               for k in sorted(mine["samples"]) if k.startswith(workload + "/")]
        assert len(per) == row["prompts"] > 0
        assert all(len(mine["samples"][k]) == 2 for k in mine["samples"])  # one sample per round
        # the tokens each prompt prefilled, the same on both sides (the replay and random prompts
        # are token ids; a text prompt tokenized by the same vocabulary)
        assert mine["prompt_tokens"].keys() == mine["samples"].keys()
        assert all(n > 0 for n in mine["prompt_tokens"].values())
        assert mine["prompt_tokens"] == {k: n for k, n in stock["prompt_tokens"].items() if k in mine["prompt_tokens"]}
        assert row[key]["ratio_median"] == pytest.approx(statistics.median(per))
        assert row[key]["ratio_lowest"] == pytest.approx(min(per))
        assert f"{row[key]['ratio_median']:.2f}x (lowest {row[key]['ratio_lowest']:.2f}x)" in rows[0]
        lo, hi = row[key]["ratio_interval"]  # two rounds: the median ratio's interval over them
        assert 0 < lo <= hi and f"{lo:.2f}x-{hi:.2f}x" in section
        for side, cfg in (("moeplug", mine), ("stock", stock)):  # each server's own round-to-round spread
            own = [min(x[test] for x in v) / max(x[test] for x in v)
                   for k, v in cfg["samples"].items() if k.startswith(workload + "/")]
            assert row["spread"][side][key] == pytest.approx(min(own)) and 0 < min(own) <= 1
    assert f"round to round, one prompt's slowest over its fastest, lowest: prefill moeplug " \
           f"{row['spread']['moeplug']['prefill']:.2f}x" in section
    assert row["vram_mib"] == {"moeplug": "null", "stock": "null"}  # no GPU: NVML holds nothing
    # the planner's model beside the run (serve_bench.model_check), printed under the table
    assert mine["plan"]["modelled_host_ms"] is not None
    d = row["decode"]
    assert row["model"]["decode_ms"]["measured"] == pytest.approx(1e3 / d["moeplug_tps"] - 1e3 / d["stock_tps"])
    assert serve_bench.model_text(row) in section


def test_serve_bench_text_and_random(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    # -n 18: answers longer than a short answer's 16 steps, so each prompt is also answered in 16
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "text,random",
                            "--warmup", "2", "--prefill-reps", "3", "-n", "18")
    for workload in ("text-profiled", "text-unseen", "random"):
        check_table(stdout, doc, workload)
    # --prefill-reps 3: each prompt's prefill, every round, the median of three answered requests
    for c in doc["configs"]:
        assert c["prefill_reps"].keys() == c["samples"].keys()
        for k, rounds in c["prefill_reps"].items():
            assert [len(r) for r in rounds] == [3, 3] and all(x > 0 for r in rounds for x in r)
            assert [s[0] for s in c["samples"][k]] == [statistics.median(r) for r in rounds]
        # the short answers (16 steps: n_predict 17) and the repeats come in passes over a workload's prompts after
        # its decoding requests, never a prompt right after itself (its own routing would then be in a dynamic
        # policy's slots)
        assert len(c["sequence"]) == 2
        for sent in c["sequence"]:
            for w in ("text-profiled", "text-unseen", "random"):
                mine = [x for x in sent if x.startswith(w + "/")]
                n = sum(1 for k in c["samples"] if k.startswith(w + "/"))
                assert n > 1 and mine == [f"{w}/{i}:{k}" for k in (18, 17) for i in range(n)] + \
                    [f"{w}/{i}:1" for i in range(n)] * 2
            assert all(a.split(":")[0] != b.split(":")[0] for a, b in zip(sent, sent[1:]))
    assert "prefill the median of 3 requests" in stdout
    # --tables-from prints the same tables again from the JSON, running nothing
    again = subprocess.run([sys.executable, str(SERVE_BENCH), "--tables-from", str(tmp_path / "bench.json")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.count("\n### ") == 3 and again.stdout.strip() in stdout
    (tmp_path / "not.json").write_text("{}")
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--tables-from", str(tmp_path / "not.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tables-from" in bad.stderr and "not a serve_bench JSON" in bad.stderr
    assert "Traceback" not in bad.stderr
    # beside the medians, each prompt's first request alone (the one after another prompt's decoding request)
    mine = next(c for c in doc["configs"] if c["side"] == "moeplug")
    stock = next(c for c in doc["configs"] if c["side"] == "stock")
    for workload in ("text-profiled", "text-unseen", "random"):
        first = [statistics.median(r[0] for r in mine["prefill_reps"][k]) /
                 statistics.median(r[0] for r in stock["prefill_reps"][k])
                 for k in mine["prefill_reps"] if k.startswith(workload + "/")]
        row = doc["tables"][workload][0]
        assert len(first) == 2 and row["prefill_first"]["ratio_lowest"] == pytest.approx(min(first))
        assert row["prefill_first"]["ratio_median"] == pytest.approx(statistics.median(first))
        assert (f"prefill of each prompt's first request alone (its decoding one; the table's median pools the "
                f"repeats): {statistics.median(first):.2f}x (lowest {min(first):.2f}x)") in stdout
    # each prompt's short answer alone: its decode ratio from the samples' third value, printed under the table
    for workload in ("text-profiled", "text-unseen", "random"):
        row = doc["tables"][workload][0]
        keys = [k for k in mine["samples"] if k.startswith(workload + "/")]
        assert all(len(s) == 3 and s[2] > 0 for k in keys for s in mine["samples"][k] + stock["samples"][k])
        short = [statistics.median(s[2] for s in mine["samples"][k]) / statistics.median(s[2] for s in stock["samples"][k])
                 for k in keys]
        d = row["decode_short"]
        assert d["steps"] == 16 and d["ratio_median"] == pytest.approx(statistics.median(short))
        assert d["ratio_lowest"] == pytest.approx(min(short)) and d["ratio_interval"] is not None
        assert (f"decode of short answers alone (16 tokens to each prompt, on the slots another prompt left): "
                f"{d['moeplug_tps']:.1f} / {d['stock_tps']:.1f} t/s, {statistics.median(short):.2f}x "
                f"(lowest {min(short):.2f}x") in stdout
    # every launch answered two warm-up requests before the measured ones, which they are not among
    assert [c["warmed"] for c in doc["configs"]] == [2 * 2] * len(doc["configs"])
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--warmup", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--warmup from 0 to 16" in bad.stderr and "Traceback" not in bad.stderr
    stock = next(c for c in doc["configs"] if c["side"] == "stock")
    mine = next(c for c in doc["configs"] if c["side"] == "moeplug")
    assert stock["binary"] == str(stock_build.binary("llama-server"))
    assert stock["server_args"][:6] == ["-c", "1024", "--fit", "on", "-fitt", "0"]
    # stock means stock: its rows ran the unpatched build, and each table says so
    assert stock["stock_binary"] == "stock" and mine["stock_binary"] is None
    for workload in ("text-profiled", "text-unseen", "random"):
        assert doc["tables"][workload][0]["stock_build"] == {"build_id": stock["build_id"], "patched": False}
    assert stdout.count(f"stock's side ran {stock['build_id']}: unpatched llama.cpp of the same pin") == 3
    assert mine["binary"] == str(patched_build.binary("llama-server")) and "-fit" in mine["server_args"]
    # same context, threads and slots on both sides
    for flag in ("-c", "-t", "-np"):
        assert mine["server_args"][mine["server_args"].index(flag) + 1] == \
            stock["server_args"][stock["server_args"].index(flag) + 1]


def test_the_planners_model_beside_the_measured_difference(tmp_path: Path) -> None:
    """A moeplug row's plan against the run: per decoded token the plan's host time less stock's
    placement's, without the prompt batches it weighs and less the streamed misses' saving, beside
    1/t/s of each side; per prompt token the modelled prompt times; no decode figure where the row
    streams another share than the plan, nothing with speculation."""
    plan = {"modelled_host_ms": 10.0, "stock_modelled_host_ms": 14.0, "prefill_weight": 1.0,
            "modelled_prompt_us": 200.0, "stock_modelled_prompt_us": 300.0, "stream_share": 0.75,
            "modelled_stream_saving_ms": 2.0, "speculation": None}
    row = {"budget": "8 GiB", "moeplug": "32 of 128", "prefill": {"moeplug_tps": 2000.0, "stock_tps": 1000.0},
           "decode": {"moeplug_tps": 100.0, "stock_tps": 50.0}}
    args = ["-ngl", "99", "--moe-cache-stream", "0.75"]
    mine = serve_bench.Config("8 GiB", "moeplug", tmp_path, "id", args, ["text"], plan=plan)
    got = serve_bench.model_check(mine, row)
    assert got["decode_ms"]["measured"] == pytest.approx(10.0 - 20.0)
    assert got["decode_ms"]["modelled"] == pytest.approx((10.0 - 0.2 - 2.0) - (14.0 - 0.3))
    assert got["prefill_us"] == {"measured": pytest.approx(500.0 - 1000.0), "modelled": pytest.approx(-100.0)}
    text = serve_bench.model_text({**row, "model": got})
    assert "decode per token -10.00 ms measured, -5.90 ms modelled" in text
    assert "prefill per prompt token -500.0 us measured, -100.0 us modelled" in text
    other = serve_bench.Config("8 GiB", "moeplug", tmp_path, "id", [*args, "--moe-cache-stream", "0"], ["text"], plan=plan)
    assert serve_bench.model_check(other, row).keys() == {"prefill_us"}  # the last flag wins: not the plan's share
    spec = serve_bench.Config("8 GiB", "moeplug", tmp_path, "id", args, ["text"], plan={**plan, "speculation": {"kind": "mtp"}})
    assert serve_bench.model_check(spec, row) is None


def test_the_median_ratio_has_an_interval_over_rounds(tmp_path: Path) -> None:
    """serve_bench.ratio_interval: each prompt's rounds drawn again with replacement on each side; the
    interval holds the measured median ratio, is narrow where the rounds agree and wide where they do
    not, is the same on every call (seeded), and is None with one round."""
    def config(side: str, rounds: list[list[float]]) -> serve_bench.Config:
        cfg = serve_bench.Config("8 GiB", side, tmp_path, "id", [], ["random"])
        for i, per_round in enumerate(rounds):
            cfg.samples[("random", i)] = [(tps, tps / 10) for tps in per_round]
        return cfg

    steady = config("moeplug", [[110, 111, 109]] * 4)
    stock = config("stock", [[100, 101, 99]] * 4)
    lo, hi = serve_bench.ratio_interval(steady, stock, "random", 0)
    assert lo <= statistics.median(serve_bench.ratios(steady, stock, "random", 0)) <= hi
    assert 1.07 < lo and hi < 1.13
    noisy = config("moeplug", [[110, 70, 140]] * 4)
    nlo, nhi = serve_bench.ratio_interval(noisy, stock, "random", 0)
    assert nhi - nlo > 4 * (hi - lo)
    assert serve_bench.ratio_interval(noisy, stock, "random", 0) == [nlo, nhi]
    assert serve_bench.ratio_interval(config("moeplug", [[110]] * 4), stock, "random", 1) is None
    row = serve_bench.table_rows([(steady, stock)], "random")[0]
    assert row["prefill"]["ratio_interval"] == [lo, hi] and row["decode"]["ratio_interval"] is not None


def test_each_round_has_its_median_over_the_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """serve_bench.per_round: round by round, the median over a workload's prompts, which shows a server
    process that ran slow in all its prompts alike; printed under the table for decode where both
    sides ran two rounds or more."""
    def config(side: str, prompts: list[list[float]]) -> serve_bench.Config:
        cfg = serve_bench.Config("8 GiB", side, tmp_path, "id", [], ["random"])
        for i, by_round in enumerate(prompts):
            cfg.samples[("random", i)] = [(10 * tps, tps) for tps in by_round]
        return cfg

    # three prompts over three rounds; moeplug's second round ran ~20% slow in every prompt
    mine = config("moeplug", [[100, 80, 101], [90, 72, 92], [110, 88, 111]])
    stock = config("stock", [[60, 61, 59], [70, 71, 69], [50, 51, 49]])
    assert serve_bench.per_round(mine, "random", 1) == [100, 80, 101]
    assert serve_bench.per_round(stock, "random", 0) == [600, 610, 590]
    assert serve_bench.per_round(mine, "text", 1) == []
    row = serve_bench.table_rows([(mine, stock)], "random")[0]
    assert row["per_round"]["moeplug"]["decode"] == [100, 80, 101]
    serve_bench.print_table("random", [row])
    assert "decode t/s round by round (median over the prompts): moeplug 100.0, 80.0, 101.0; stock 60.0, 61.0, 59.0" \
        in capsys.readouterr().out
    one = config("stock", [[60], [70], [50]])
    serve_bench.print_table("random", serve_bench.table_rows([(mine, one)], "random"))
    assert "round by round" not in capsys.readouterr().out


def test_delayed_prefill_requests_are_counted_apart(tmp_path: Path) -> None:
    """serve_bench.delayed_share: per configuration, the share of decoding requests and of one-token
    repeats whose prefill took more than SLOW_REQUEST_MS longer than the prompt's fastest request;
    None without repeats."""
    cfg = serve_bench.Config("8 GiB", "moeplug", tmp_path, "id", [], ["random"])
    cfg.prompt_tokens[("random", 0)] = 100
    # 100 tokens: 10 ms at 10000 t/s; 2500 t/s is 40 ms (delayed), 8000 t/s 12.5 ms (not)
    cfg.prefill_reps[("random", 0)] = [[10000, 2500, 8000, 10000], [2500, 10000, 10000, 10000]]
    assert serve_bench.delayed_share(cfg, "random") == [pytest.approx(1 / 2), pytest.approx(1 / 6)]
    assert serve_bench.delayed_share(cfg, "text-unseen") is None
    cfg.prefill_reps[("random", 0)] = [[10000], [2500]]
    assert serve_bench.delayed_share(cfg, "random") is None


def test_serve_bench_chat(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--workloads chat: each unseen prompt a conversation of three turns, every turn after the first
    prefilling its new text alone, the conversation before it held by the server's prompt cache."""
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "chat")
    check_table(stdout, doc, "chat")
    assert doc["tables"]["chat"][0]["prompts"] == 2 * serve_bench.CHAT_TURNS
    # the opening turns (a new conversation) and the later ones apart, each from the same per-turn ratios
    row, (mine, stock) = doc["tables"]["chat"][0], [next(c for c in doc["configs"] if c["side"] == side)
                                                    for side in ("moeplug", "stock")]
    for (what, test), opening in itertools.product((("prefill", 0), ("decode", 1)), (True, False)):
        per = [statistics.median(s[test] for s in mine["samples"][k]) /
               statistics.median(s[test] for s in stock["samples"][k])
               for k in mine["samples"] if (int(k.split("/")[1]) % serve_bench.CHAT_TURNS == 0) == opening]
        assert len(per) == (2 if opening else 4)
        key = f"{what}_{'opening' if opening else 'later'}"
        assert row[key] == pytest.approx({"ratio_median": statistics.median(per), "ratio_lowest": min(per)})
    assert "the opening turns alone (a new conversation, on the slots another one left): prefill" in stdout
    for c in doc["configs"]:
        ctx, new = c["context_tokens"], c["prompt_tokens"]
        for conv in range(2):
            turns = [f"chat/{conv * serve_bench.CHAT_TURNS + t}" for t in range(serve_bench.CHAT_TURNS)]
            for before, turn in zip(turns, turns[1:]):
                # the conversation grew by the answer (4 tokens, -n 4) and the turn's text, and the server's
                # prompt cache held at least half of what came before (all but the answer's last token, or,
                # with this model's 128-token sliding window, back to its last checkpoint)
                assert ctx[turn] > ctx[before] + 4 and ctx[turn] - new[turn] >= ctx[before] // 2
        for sent in c["sequence"]:
            assert sent == [f"{k}:4" for k in sorted(ctx, key=lambda k: int(k.split("/")[1]))]
    # the turns are the unseen prompts cut, nothing lost or added, every turn some text
    for text in read_prompts(serve_bench.UNSEEN_PROMPTS):
        turns = serve_bench.chat_turns(text)
        assert len(turns) == serve_bench.CHAT_TURNS and "".join(turns) == text and all(turns)


def test_serve_bench_concurrent(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--workloads concurrent: the unseen prompts in groups of --streams sent at once, both servers with
    that many parallel slots on one KV cache; a table row per budget as for the other workloads, a
    prompt being a group."""
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "concurrent",
                            "--streams", "2", "--max-prompts", "4")
    check_table(stdout, doc, "concurrent")
    assert doc["tables"]["concurrent"][0]["prompts"] == 2  # four prompts, two groups of two
    for c in doc["configs"]:
        args = " ".join(c["server_args"])
        assert "-np 2 -kvu" in args, args
        for sent in c["sequence"]:
            assert sent == ["concurrent/0:4x2", "concurrent/1:4x2"]


def test_serve_bench_replay(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    help_text = subprocess.run([str(patched_build.binary("llama-server")), "--help"], capture_output=True,
                               text=True).stdout
    if REPLAY_FLAG not in help_text:
        pytest.skip(f"the patched llama-server does not list {REPLAY_FLAG} yet (the engine half of issue 18)")
    write_npz(tmp_path / "trace.npz", prompts=12)
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "replay",
                            "--trace", str(tmp_path / "trace.npz"), "--train-prompts", "0:8",
                            "--replay-prompts", "8:", "--row-env", "GGML_SCHED_HOST_OVERLAP=0")
    check_table(stdout, doc, "replay")
    for c in doc["configs"]:
        assert c["server_args"][c["server_args"].index(REPLAY_FLAG) + 1].endswith(".gguf")
        # --row-env: the moeplug server's environment only, named in its row
        assert c["env"].get("GGML_SCHED_HOST_OVERLAP") == ("0" if c["side"] == "moeplug" else None)
    assert doc["tables"]["replay"][0]["moeplug"].endswith(", GGML_SCHED_HOST_OVERLAP=0")
    # replay's flag is ours: stock's rows ran the patched build with stock's flags, and the table says so
    stock = next(c for c in doc["configs"] if c["side"] == "stock")
    assert stock["binary"] == str(patched_build.binary("llama-server")) and stock["stock_binary"] == "patched"
    assert doc["tables"]["replay"][0]["stock_build"] == {"build_id": stock["build_id"], "patched": True}
    assert (f"stock's side ran the patched build {stock['build_id']} with stock's flags (the replay flag is ours: no "
            f"stock build has it), not an unpatched llama.cpp") in stdout


def test_serve_bench_copy_ahead_rows(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--copy-ahead on,off: two moeplug rows, the second planned without the copies ahead and its
    server run with --moe-cache-copy-ahead off (on the CPU build both hold their slots in RAM: --moe-cache-device CPU)."""
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--copy-ahead", "on,off")
    rows = doc["tables"]["random"]
    assert len(rows) == 2 and rows[1]["moeplug"] == rows[0]["moeplug"] + ", no copies ahead"
    mine = [c for c in doc["configs"] if c["side"] == "moeplug"]
    assert [c["plan"]["copy_ahead"] for c in mine] == [True, False]
    ahead = [c["server_args"][c["server_args"].index("--moe-cache-copy-ahead") + 1] if "--moe-cache-copy-ahead" in c["server_args"]
             else None for c in mine]
    assert ahead == [None, "off"] and all("GGML_SCHED_EXPERT_COPY_AHEAD" not in c["env"] for c in mine)
    assert all(c["server_args"].count("--moe-cache-device") == 1 for c in mine)
    assert all(len(v) == 2 for c in mine for v in c["samples"].values())  # both served every round
    # one request per prompt: no first-request line beside the medians, which are those requests already
    assert all(r["prefill_first"] is None for r in rows) and "first request" not in stdout
    for flag, value, said in (("--copy-ahead", "sideways", "--copy-ahead: 'sideways'"),
                              ("--prefill-reps", "0", "--prefill-reps: from 1 to 32")):
        bad = subprocess.run([sys.executable, str(SERVE_BENCH), flag, value], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and said in bad.stderr and "Traceback" not in bad.stderr


def test_serve_bench_stock_within_the_budget(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--stock-vram fit,budget: two stock rows per budget, stock as users run it and stock held to the
    budget, each moeplug row against each, in the tables and again from the JSON (--tables-from). Without
    a GPU the second row's -fitt stays what it was: NVML holds nothing to calibrate it with."""
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--stock-vram", "fit,budget", "--rounds", "1")
    rows = doc["tables"]["random"]
    assert [r["stock"] for r in rows] == ["--fit", "--fit within the budget"]
    assert len({r["moeplug"] for r in rows}) == 1
    assert f"{rows[0]['moeplug']} vs stock --fit within the budget |" in stdout
    stocks = [c for c in doc["configs"] if c["side"] == "stock"]
    assert [c["vram_cap"] for c in stocks] == [None, None] and all(not c["fit_tries"] for c in stocks)
    assert stocks[0]["server_args"] == stocks[1]["server_args"]
    assert all(len(v) == 1 for c in stocks for v in c["samples"].values())  # both served the round
    again = subprocess.run([sys.executable, str(SERVE_BENCH), "--tables-from", str(tmp_path / "bench.json")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "vs stock --fit within the budget |" in again.stdout, again.stderr
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--stock-vram", "fit,fit"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--stock-vram: 'fit,fit'" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_bench_row_args_and_stock_threads(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--row-args 'none;--no-op-offload': a moeplug row per set of extra server flags, last in its
    flags; --stock-threads 0,1: a stock row per thread count, 0 with no -t at all (llama.cpp's default,
    also where --threads gave both sides one), 1 running the server on one thread (its log says so);
    every moeplug row against every stock row."""
    logs = tmp_path / "logs"
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--rounds", "1", "--row-args", "none;--no-op-offload", "--stock-threads", "0,1",
                            "--keep-logs", str(logs))
    rows = doc["tables"]["random"]
    assert [(r["moeplug"].endswith(", --no-op-offload"), r["stock"]) for r in rows] == [
        (False, "--fit, default -t"), (False, "--fit, -t 1"), (True, "--fit, default -t"), (True, "--fit, -t 1")]
    mine = [c for c in doc["configs"] if c["side"] == "moeplug"]
    stocks = [c for c in doc["configs"] if c["side"] == "stock"]
    assert "--no-op-offload" not in mine[0]["server_args"] and mine[1]["server_args"][-1] == "--no-op-offload"
    assert "-t" not in stocks[0]["server_args"] and stocks[1]["server_args"][-2:] == ["-t", "1"]
    assert all(len(v) == 1 for c in doc["configs"] for v in c["samples"].values())  # all served the round
    one = [p for p in logs.iterdir() if "-stock-" in p.name and "n_threads = 1 (" in p.read_text()]
    assert len(one) == 1, sorted(p.name for p in logs.iterdir())
    for flag, value, said in (("--row-args", "none;", "--row-args: 'none;': an empty set"),
                              ("--row-args", "no-op", "--row-args: 'no-op': flags of llama-server"),
                              ("--stock-args", "ub 64", "--stock-args: 'ub 64': flags of llama-server"),
                              ("--ubatches", "512,16", "--ubatches: whole numbers of 32 or more, or auto"),
                              ("--ubatches", "auto,x", "--ubatches: 'x': give numbers, e.g. 512,2048,auto"),
                              ("--prompt-tokens", "0,-5", "--prompt-tokens: whole numbers, 0 or more"),
                              ("--stock-threads", "8,8", "--stock-threads: '8,8': distinct counts"),
                              ("--stock-threads", "x", "--stock-threads: 'x': thread counts")):
        bad = subprocess.run([sys.executable, str(SERVE_BENCH), flag, value], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and said in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--ubatches", "512,2048", "--spec", "mtp"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ubatches above 512 with --spec mtp: not planned yet" in bad.stderr, bad.stderr


def test_serve_bench_keeps_logs_with_the_timeline(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--env GGML_SCHED_TIMELINE=4 reaches both servers, --keep-logs copies each round's log, and
    native/bench/timeline.py reads the patched server's reports from it (the stock build has no
    patch 0024: its log has none, and timeline.py says so)."""
    logs = tmp_path / "logs"
    run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random", "--rounds", "1",
              "--env", "GGML_SCHED_TIMELINE=4", "--keep-logs", str(logs))
    kept = sorted(p.name for p in logs.iterdir())
    assert len(kept) == 2 and all(n.endswith("-r1.log") for n in kept), kept
    (mine,) = [logs / n for n in kept if "-moeplug-" in n]
    (theirs,) = [logs / n for n in kept if "-stock-" in n]
    assert "ggml_backend_sched_timeline_report" in mine.read_text()
    sys.path.insert(0, str(SERVE_BENCH.parent))
    import timeline

    shapes = timeline.parse(mine.read_text())
    decode = max(shapes.values(), key=lambda sh: sh.graphs)
    assert decode.graphs >= 4 and len(decode.splits) == decode.n_splits >= 1
    assert all(backend == "CPU" for backend in timeline.by_backend(decode))  # slots in RAM: the CPU alone
    # the splits' sums are the graph's, as the report's head line gives it
    assert sum(s.t_inputs + s.t_compute for s in decode.splits) == pytest.approx(decode.t_inputs + decode.t_compute,
                                                                                 rel=0.02, abs=decode.graphs)
    assert timeline.parse(theirs.read_text()) == {}
    out = tmp_path / "timeline.json"
    r = subprocess.run([sys.executable, str(SERVE_BENCH.parent / "timeline.py"), str(mine), str(theirs),
                        "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"## {mine.name}" in r.stdout and "busiest splits" in r.stdout
    assert f"## {theirs.name}\nno timeline reports" in r.stdout
    assert json.loads(out.read_text())[str(mine)][str(decode.n_splits)]["graphs"] == decode.graphs
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--env", "GGML_SCHED_TIMELINE"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--env: 'GGML_SCHED_TIMELINE'" in bad.stderr and "Traceback" not in bad.stderr
    missing = subprocess.run([sys.executable, str(SERVE_BENCH.parent / "timeline.py"), str(tmp_path / "nope.log")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "nope.log" in missing.stderr and "Traceback" not in missing.stderr


def test_timeline_sets_prompt_batches_beside_the_request_before_them(patched_build, stock_build, bench_model: Path,
                                                                     tmp_path: Path) -> None:
    """At GGML_SCHED_TIMELINE=1 every graph is a report, and `timeline.py --prompts` finds each request's
    prompt batch in a real server's log: after the warm-up's answer and the decoding requests, and after a
    repeat's one-token request (--prefill-reps 2), with the host's time in the batch's splits inside the
    prompt time llama-server printed for it."""
    logs = tmp_path / "logs"
    run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random", "--rounds", "1",
              "--prefill-reps", "2", "--env", "GGML_SCHED_TIMELINE=1", "--keep-logs", str(logs))
    (mine,) = [p for p in logs.iterdir() if "-moeplug-" in p.name]
    (theirs,) = [p for p in logs.iterdir() if "-stock-" in p.name]
    sys.path.insert(0, str(SERVE_BENCH.parent))
    import timeline

    tasks, n_ubatch = timeline.parse_tasks(mine.read_text())
    assert n_ubatch == 512 and all(t.prompt_ms is not None and t.generated is not None for t in tasks)
    batches = timeline.prompt_batches(tasks, n_ubatch)
    # the warm-up and the two prompts' decoding requests end in answers (-n 4); of the repeats, the first
    # follows an answer, the second the first repeat's one token
    random16 = [b for b in batches if b.tokens == 16]
    assert sorted(b.after for b in random16) == ["answer", "answer", "answer", "one token"], random16
    for b in batches:
        assert len(b.graphs) == 1 and b.graphs[0].splits
        assert 0 < b.host_ms <= b.prompt_ms + 0.1, (b.host_ms, b.prompt_ms)
    r = subprocess.run([sys.executable, str(SERVE_BENCH.parent / "timeline.py"), "--prompts", str(mine), str(theirs)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "| 16 | answer | 3 |" in r.stdout and "| 16 | one token | 1 |" in r.stdout
    assert "16-token prompt graphs, splits by how much more host time" in r.stdout
    assert f"## {theirs.name}: prompt batches by the request before them\nno prompt batches" in r.stdout


def test_fit_within_launches_stock_and_reads_what_it_holds(stock_build, bench_model: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """fit_within launches the stock server as a round does (context probe, warm-up) and records what
    NVML says it held: on the CPU nothing, so one launch, -fitt unchanged, no error."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    binary = stock_build.binary("llama-server")
    cfg = serve_bench.Config("25%", "stock", binary, stock_build.build_id,
                             ["-c", "1024", "--fit", "on", "-fitt", "0", "-t", "2", "-np", "1"], ["random"], vram_cap=1)
    serve_bench.fit_within(cfg, bench_model, 1024, [[1, 2, 3, 4]])
    assert cfg.fit_tries == [{"fitt": 0, "held_bytes": None}] and cfg.errors == []
    assert cfg.server_args[cfg.server_args.index("-fitt") + 1] == "0"


def test_copy_ahead_rows_parse_auto() -> None:
    """--copy-ahead takes on, off and auto (the planner's choice) in any list; anything else is
    argparse's one-line error."""
    import argparse

    ap = argparse.ArgumentParser()
    assert serve_bench.copy_aheads(ap, "") == [None]
    assert serve_bench.copy_aheads(ap, "auto,off") == [None, False]
    assert serve_bench.copy_aheads(ap, " on , auto ") == [True, None]
    with pytest.raises(SystemExit):
        serve_bench.copy_aheads(ap, "on,maybe")


def test_serve_bench_prices_recording(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--policies auto,auto+record: two moeplug rows of the same plan against stock, the second
    recording live routing counts, and a table of the second against the first (what recording
    costs)."""
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--policies", "auto,auto+record")
    rows = doc["tables"]["random"]
    assert len(rows) == 2 and rows[1]["moeplug"] == rows[0]["moeplug"] + "+record"
    mine = [c for c in doc["configs"] if c["side"] == "moeplug"]
    assert ["--moe-cache-record" in c["server_args"] for c in mine] == [False, True]
    assert [a for a in mine[1]["server_args"] if a != "--moe-cache-record"] == mine[0]["server_args"]
    (cost,) = doc["tables"]["random/record"]
    a, b = ({k: v for k, v in c["samples"].items()} for c in reversed(mine))
    per = [statistics.median(s[1] for s in a[k]) / statistics.median(s[1] for s in b[k]) for k in sorted(a)]
    assert cost["decode"]["ratio_median"] == pytest.approx(statistics.median(per))
    assert "### random: recording's cost, with --moe-cache-record / without" in stdout
    assert f"{cost['decode']['ratio_median']:.3f}x (lowest {cost['decode']['ratio_lowest']:.3f}x)" in stdout
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--policies", "dynamic+count"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--policies: 'dynamic+count'" in bad.stderr


def test_serve_bench_with_speculation(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--spec draft:PATH --spec-accept 0.7 --spec-baseline: both sides speculate with the same draft
    model and synthetic acceptance (rates 0.7, 0.49, 0.343 for 3 draft tokens), and moeplug's row is
    also set against stock without speculation; drafted tokens are counted on both sides."""
    spec = ModelSpec(arch="gpt-oss", layers=2, experts=32, used=4, embd=64, expert_ff=64, heads=4, heads_kv=2,
                     head_dim=16, dtype="f16", expert_dtype="mxfp4", seed=12)
    draft = make_model(spec, tmp_path / "draft.gguf")[0]
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--spec", f"draft:{draft}", "--spec-accept", "0.7", "--spec-baseline")
    rows = doc["tables"]["random"]
    assert [r["stock"] for r in rows] == ["--fit, draft", "--fit, no speculation"]
    assert rows[0]["moeplug"] == rows[1]["moeplug"] and rows[0]["moeplug"].endswith(", draft")
    stock, baseline = (c for c in doc["configs"] if c["side"] == "stock")
    mine = next(c for c in doc["configs"] if c["side"] == "moeplug")
    synth = ["--spec-synth-rates", "0.700000,0.490000,0.343000"]
    for c in (stock, mine):
        args = c["server_args"]
        assert args[args.index("-md") + 1] == str(draft) and args[args.index("--spec-type") + 1] == "draft-simple"
        assert args[args.index("--spec-synth-rates"):][:2] == synth
        drafted, accepted = c["drafts"]["random"]
        assert drafted > 0 and 0 < accepted <= drafted
    assert "-md" not in baseline["server_args"] and not baseline["drafts"]
    assert "vs stock --fit, no speculation |" in stdout
    bad = subprocess.run([sys.executable, str(SERVE_BENCH), "--spec", "bogus"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--spec 'bogus'" in bad.stderr


def test_serve_bench_two_gpu_budgets(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--budgets 2+2 (GiB on each of two GPUs): moeplug's plan splits the layers (-sm layer
    --tensor-split), stock --fit gets a -fitt per GPU; a malformed per-GPU budget is refused."""
    _, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                       "--budgets", "2+2", "--rounds", "1")
    (row,) = doc["tables"]["random"]
    assert row["budget"] == "2+2 GiB" and row["decode"]["ratio_median"] > 0
    stock = next(c for c in doc["configs"] if c["side"] == "stock")["server_args"]
    mine = next(c for c in doc["configs"] if c["side"] == "moeplug")["server_args"]
    assert stock[stock.index("-fitt") + 1] == "0,0"  # no GPU: nothing to leave free
    assert mine[mine.index("-sm") + 1] == "layer" and len(mine[mine.index("--tensor-split") + 1].split(",")) == 2
    for bad in ("8+", "8+8+8", "0+8"):
        r = subprocess.run([sys.executable, str(SERVE_BENCH), "--budgets", bad], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "GiB for each of two GPUs (8+8)" in r.stderr, r.stderr


def test_serve_bench_ubatches_and_stock_args(patched_build, stock_build, bench_model: Path, tmp_path: Path) -> None:
    """--ubatches 512,64: a moeplug row per physical batch its plan is made for (the server's -b and -ub);
    --stock-args 'none;-ub 64 -b 64': a stock row per set of extra
    flags, last in its flags; every moeplug row against every stock row, and the prompts of 100 tokens
    prefill in two ubatches of 64 on the rows that ask for it (the logs say n_ubatch = 64)."""
    logs = tmp_path / "logs"
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--random-tokens", "100", "--rounds", "1", "--ubatches", "512,64",
                            "--stock-args", "none;-ub 64 -b 64", "--keep-logs", str(logs))
    rows = doc["tables"]["random"]
    assert [(r["moeplug"].split(", ")[-1], r["stock"]) for r in rows] == [
        ("-ub 512", "--fit"), ("-ub 512", "--fit, -ub 64 -b 64"), ("-ub 64", "--fit"), ("-ub 64", "--fit, -ub 64 -b 64")]
    mine = [c for c in doc["configs"] if c["side"] == "moeplug"]
    stocks = [c for c in doc["configs"] if c["side"] == "stock"]
    assert "-ub" not in mine[0]["server_args"] and mine[0]["plan"]["ubatch"] == 512
    args = mine[1]["server_args"]
    assert args[args.index("-ub") + 1] == "64" and args[args.index("-b") + 1] == "2048"
    assert mine[1]["plan"]["ubatch"] == 64
    assert "-ub" not in stocks[0]["server_args"] and stocks[1]["server_args"][-4:] == ["-ub", "64", "-b", "64"]
    assert all(len(v) == 1 for c in doc["configs"] for v in c["samples"].values())  # all served the round
    assert all(n == 100 for c in doc["configs"] for n in c["prompt_tokens"].values())
    small = sorted(p.name.split("-random")[0] for p in logs.iterdir()
                   if re.search(r"n_ubatch +=  *64\n", p.read_text()))
    assert len(small) == 2 and sum("-stock-" in n for n in small) == 1, small


def test_tables_from_runs_before_and_after_the_short_answers() -> None:
    """--tables-from on two H200 runs kept in the repository: one from before the short answers (two values
    a sample: no short-answer line) and `native/bench/results/2026-12-04-chat-16gib/short-answers/`, whose lines it prints again."""
    results = SERVE_BENCH.parent / "results"
    runs = [results / "2026-12-04-chat-opening-turns" / "chat-policies" / "r44.json", results / "2026-12-04-chat-16gib" / "short-answers" / "short.json"]
    before, after = (subprocess.run([sys.executable, str(SERVE_BENCH), "--tables-from", str(r)], capture_output=True,
                                    text=True, timeout=60) for r in runs)
    assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
    assert "| 12 GiB | 35-128 of 128 per layer (19 whole layers), dynamic | 6 | 1294.0 / 1055.2 | 1.23x (lowest 1.17x) " \
        "| 85.8 / 92.2 | 0.94x (lowest 0.86x) |" in before.stdout
    assert "short answers" not in before.stdout
    lines = [line for line in after.stdout.splitlines() if "decode of short answers alone" in line]
    assert [line.split("prompt left): ", 1)[1] for line in lines] == [
        "81.6 / 75.5 t/s, 1.08x (lowest 0.87x), 95% interval 0.89x-1.30x",
        "86.0 / 70.4 t/s, 1.12x (lowest 0.97x), 95% interval 1.03x-1.29x",
        "83.6 / 83.6 t/s, 0.97x (lowest 0.89x), 95% interval 0.90x-1.18x"]
    # the tables as the run printed them
    recorded = (results / "2026-12-04-chat-16gib" / "short-answers" / "short.md").read_text()
    assert all(line in recorded for line in after.stdout.splitlines() if line.startswith("| 12 GiB"))


def test_serve_bench_stock_rows_on_the_patched_build(patched_build, stock_build, bench_model: Path,
                                                      tmp_path: Path) -> None:
    """--stock-binary patched: the stock rows run the patched build with stock's flags, and the JSON's rows,
    the line under each table and the run's last line say so."""
    stdout, doc = run_bench(patched_build, stock_build, bench_model, tmp_path, "--workloads", "random",
                            "--rounds", "1", "--stock-binary", "patched")
    stock = next(c for c in doc["configs"] if c["side"] == "stock")
    assert stock["binary"] == str(patched_build.binary("llama-server")) and stock["stock_binary"] == "patched"
    assert not any(a.startswith("--moe-cache") for a in stock["server_args"])
    assert doc["tables"]["random"][0]["stock_build"] == {"build_id": stock["build_id"], "patched": True}
    assert (f"stock's side ran the patched build {stock['build_id']} with stock's flags, not an unpatched "
            f"llama.cpp") in stdout
    assert f"stock rows on the patched build {stock['build_id']} with stock's flags" in stdout


def test_tables_from_says_which_build_stock_ran() -> None:
    """A run written before its rows said which build stock ran is read from the build's id: the committed
    runs passed the patched build as --prebuilt-stock, and --tables-from now says so under every table; a
    row that says, or an id that names neither kind, as it says."""
    run = SERVE_BENCH.parent / "results" / "2026-12-04-chat-16gib" / "short-answers" / "short.json"
    out = subprocess.run([sys.executable, str(SERVE_BENCH), "--tables-from", str(run)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stdout.splitlines() if line.startswith("stock's side ran")]
    assert len(said) == out.stdout.count("\n### ") and all(
        "b11434-cuda-moeplug-" in line and "with stock's flags, not an unpatched llama.cpp" in line for line in said)

    def stock(build_id: str, kind: str | None) -> serve_bench.Config:
        return serve_bench.Config("8 GiB", "stock", Path("/x/llama-server"), build_id, [], ["random"], stock_binary=kind)

    assert serve_bench.stock_build(stock("b11434-cuda-stock-0123", None)) == {"build_id": "b11434-cuda-stock-0123",
                                                                              "patched": False}
    assert serve_bench.stock_build(stock("prebuilt /opt/bin", None))["patched"] is None
    assert serve_bench.stock_build(stock("prebuilt /opt/bin", "patched"))["patched"] is True
    rows = [{"stock_build": serve_bench.stock_build(stock("prebuilt /opt/bin", None))}]
    assert serve_bench.stock_build_text("random", rows) == [
        "stock's side ran prebuilt /opt/bin (this run's JSON does not say whether it was patched)"]
