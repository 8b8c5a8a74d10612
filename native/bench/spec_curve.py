"""The verification cost curve: what speculative decoding can give on top of the expert cache, for
any acceptance rate and draft length, against stock --fit doing the same.

    python native/bench/spec_curve.py --shape gpt-oss-20b --budgets 25%,50% --ks 1-16 --depths 256,4096 \\
        --trace ../shared/data/traces/gpt-oss-20b/decode-routing-mmlu.npz --train-prompts 0:400 --replay-prompts 400:

Speculation drafts n tokens and the trunk verifies them in one batch of k = n + 1 tokens. What a
batch costs decides everything: with every expert in VRAM, a batch of 4 costs little more than one
token; with experts in RAM, each token of the batch may pick other experts, and the CPU reads every
picked expert once per batch. Consecutive tokens of one prompt pick alike (in the real gpt-oss-20b
trace 4 consecutive tokens touch 9.3 of 32 experts per layer, not 16), so the curve must be taken
on recorded routing, not random tokens.

T(k, d): the time of one batch of k tokens at context depth d, from llama-bench `-p k -d d` with
`--moe-route-replay` (the trace's held-out prompts: every test takes the next prompt, its tokens in
order), for two rows at each budget, run side by side in interleaved rounds:

  stock     llama-bench `-fitt (free VRAM - budget)` (stock's flags on the patched build: the
            replay flag is ours, the patches are opt-in)
  moeplug   the planner's placement for the budget (`moeplug.operations.install.plan_for`, the profile of the
            trace's training prompts) with the plan's slot policy (`--policy` to force one); with
            the dynamic policy the slots follow the replayed prompts from test to test, as in a
            server

Depth matters to the dynamic policy beyond the KV cache: llama-bench fills the context before each
timed batch through the same cache, the first d tokens of the prompt the batch continues, so the
slots have followed that prompt by then, as a server's have by the time it decodes. At depth 0 they
see only the batches' own few tokens: on the H200 (run `2026-12-02-server-rounds-vram`, gpt-oss-20b shape, 25%)
moeplug's batches got faster through the run (k = 1 first, 32-40 ms; k = 4 later, 29-35 ms) while
stock's held steady, and its T(1) of 34 ms was far from the 18.9 ms per token the server decoded
at on the same plan. So the default depths are 256 and 4096.

From T, for a per-token acceptance rate a (each drafted token accepted with probability a while the
ones before it were) and a draft of n tokens, a verification step yields
E(a, n) = (1 - a^(n+1)) / (1 - a) tokens (the accepted ones and the trunk's own next token) and costs
T(n + 1, d) + n * t_draft, so speculative decoding runs at E / (T(n+1, d) + n t_draft) tokens/s,
against 1 / T(1, d) without it. t_draft (`--draft-ms`) is the drafter's time per token: ~0 for
n-gram drafts, one small layer for an MTP head, a small model's decode step for a draft model.

Printed: T per k and depth for both rows with the ratio, then per depth the expected tokens/s at
acceptance 0.5-0.9 and the best draft length of 1-8 for each side, as ratios against stock without
speculation and against stock with the same speculation. On a CPU build it runs as a smoke test
(slots in RAM, LLAMA_MOE_CACHE_DEVICE=CPU; no VRAM budget: stock's fit has nothing to fit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import GIB, free_vram_or_say, interleaved_rounds, median  # noqa: E402
from serve_bench import (DEFAULT_TRACE, budget_bytes, build_of, env_desc, fit_targets, parse_budgets,  # noqa: E402
                         prepare_model, replay_inputs, row_envs, stream_shares)

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)
DRAFT_LENGTHS = range(1, 9)


def expected_tokens(a: float, n: int) -> float:
    """Tokens one verification step yields with n drafted tokens, each accepted with probability
    a once the ones before it were: 1 + a + a^2 + ... + a^n."""
    return float(n + 1) if a >= 1.0 else (1.0 - a ** (n + 1)) / (1.0 - a)


def spec_tokens_per_s(batch_s: dict[int, float], a: float, n: int, draft_s: float) -> float | None:
    """Expected tokens/s of speculative decoding with n draft tokens, from the batch times
    (seconds per batch of k tokens); None where the batch of n + 1 was not measured."""
    t = batch_s.get(n + 1)
    return expected_tokens(a, n) / (t + n * draft_s) if t else None


def best_draft(batch_s: dict[int, float], a: float, draft_s: float) -> tuple[int, float] | None:
    """The draft length of 1-8 with the highest expected tokens/s, and that rate."""
    rates = [(n, r) for n in DRAFT_LENGTHS if (r := spec_tokens_per_s(batch_s, a, n, draft_s))]
    return max(rates, key=lambda x: x[1]) if rates else None


@dataclass
class Row:
    budget: str
    side: str  # moeplug | stock
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    desc: str = ""
    # per (k, depth): seconds per batch of every repetition of every round
    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def batch_s(self, depth: int) -> dict[int, float]:
        """Median seconds per batch of k tokens at this depth, per measured k."""
        out = {}
        for key, values in self.samples.items():
            k, d = map(int, key.split("@"))
            if d == depth and values:
                out[k] = median(values)
        return out


def parse_ks(text: str) -> list[int]:
    """'1-16' or '1,2,4,8': the batch sizes to time."""
    ks: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        try:
            lo_i, hi_i = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"--ks: {part!r} is not a batch size or a range like 1-16") from None
        if lo_i < 1 or hi_i < lo_i or hi_i > 64:
            raise ValueError(f"--ks: {part!r} is out of 1-64")
        ks.update(range(lo_i, hi_i + 1))
    if not ks:
        raise ValueError("--ks: no batch size given")
    return sorted(ks)


def run_row(binary: Path, model: Path, row: Row, ks: list[int], depths: list[int], reps: int, replay: Path,
            threads: int | None) -> None:
    """One llama-bench run of the row: every k at every depth, reps repetitions each (the first
    repetition of each test dropped as a warm-up where there are several)."""
    cmd = [str(binary), "-m", str(model), "-p", ",".join(map(str, ks)), "-n", "0", "-d", ",".join(map(str, depths)),
           "-ub", str(max(ks)), "-r", str(reps + (1 if reps > 1 else 0)), "-fa", "1", "-o", "json",
           "--moe-route-replay", str(replay), *(["-t", str(threads)] if threads else []), *row.args]
    started = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **row.env})
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        row.errors.append(tail)
        print(f"# failed: {' '.join(cmd)}\n# {tail}", file=sys.stderr)
        return
    for test in json.loads(r.stdout):
        ts = list(test.get("samples_ts") or [test["avg_ts"]])
        ts = ts[1:] if len(ts) > 1 else ts
        key = f"{test['n_prompt']}@{test.get('n_depth', 0)}"
        row.samples.setdefault(key, []).extend(test["n_prompt"] / v for v in ts if v > 0)
    print(f"# {row.budget} {row.side:<8} {len(r.stdout)} bytes of results ({time.time() - started:.0f} s)",
          file=sys.stderr)


def curve_table(pairs: list[tuple[Row, Row]], ks: list[int], depths: list[int]) -> list[dict]:
    print("\n### time of one verification batch (ms), moeplug vs stock --fit\n")
    print("| budget | moeplug | depth | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|---|---:|" + "---:|" * len(ks))
    out = []
    for mine, stock in pairs:
        for d in depths:
            m, s = mine.batch_s(d), stock.batch_s(d)
            cells = [f"{m[k] * 1e3:.2f} / {s[k] * 1e3:.2f} ({s[k] / m[k]:.2f}x)" if k in m and k in s else "-"
                     for k in ks]
            print(f"| {mine.budget} | {mine.desc} | {d} | " + " | ".join(cells) + " |")
            out.append({"budget": mine.budget, "moeplug": mine.desc, "depth": d,
                        "moeplug_ms": {k: v * 1e3 for k, v in m.items()}, "stock_ms": {k: v * 1e3 for k, v in s.items()}})
    print("\nCells: moeplug ms / stock ms (stock / moeplug: above 1.00x moeplug's batch is faster).")
    return out


def speedup_table(pairs: list[tuple[Row, Row]], depths: list[int], draft_s: float) -> list[dict]:
    print(f"\n### expected decode with speculation (draft cost {draft_s * 1e3:.2f} ms per token)\n")
    print("| budget | moeplug | depth | acceptance | stock, no spec t/s | stock + spec t/s (n) | moeplug + spec t/s (n) "
          "| vs stock without | vs stock with |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    out = []
    for mine, stock in pairs:
        for d in depths:
            m, s = mine.batch_s(d), stock.batch_s(d)
            if 1 not in s:
                continue
            base = 1.0 / s[1]
            for a in ACCEPTANCE:
                bm, bs = best_draft(m, a, draft_s), best_draft(s, a, draft_s)
                if not bm or not bs:
                    continue
                print(f"| {mine.budget} | {mine.desc} | {d} | {a:.1f} | {base:.1f} | {bs[1]:.1f} ({bs[0]}) | {bm[1]:.1f} ({bm[0]}) "
                      f"| {bm[1] / base:.2f}x | {bm[1] / bs[1]:.2f}x |")
                out.append({"budget": mine.budget, "moeplug": mine.desc, "depth": d, "acceptance": a, "stock_tps": base,
                            "stock_spec_tps": bs[1], "stock_spec_n": bs[0], "moeplug_spec_tps": bm[1],
                            "moeplug_spec_n": bm[0]})
    print("\nn: the draft length of 1-8 with the highest expected rate for that side; "
          "t/s = E(a, n) / (T(n+1) + n t_draft).")
    return out


def main(argv: list[str] | None = None) -> int:
    from moeplug.planner.fit_estimate import gpu_need
    from moeplug.operations.install import plan_for
    from moeplug.planner.request import PlanRequest
    from moeplug.model.inspect import inspect_model
    from moeplug.planner.record import describe_slots
    from moeplug.planner.server_flags import placement_args
    from moeplug.profile.format import read_profile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt-oss-20b", choices=("qwen3-30b-a3b", "gpt-oss-20b"),
                    help="synthetic model shape written when --model is missing")
    ap.add_argument("--model", type=Path, help="the model (default /tmp/moeplug-bench/SHAPE-shape.gguf, written)")
    ap.add_argument("--budgets", default="25%,50%", help="VRAM budgets: GiB (8,12) or shares of the expert bytes (25%%)")
    ap.add_argument("--ks", default="1-16", help="batch sizes to time: a range (1-16) or a list (1,2,4,8)")
    ap.add_argument("--depths", default="256,4096", help="context depths the batches run at (the dynamic slots "
                    "follow the first d tokens of each batch's prompt; at 0 they have seen none of it)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of every batch in one llama-bench run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policy", default="auto", choices=("auto", "static", "dynamic"),
                    help="moeplug's slot policy (auto: the plan's choice)")
    ap.add_argument("--draft-ms", type=float, default=0.0, help="drafter time per drafted token, milliseconds")
    ap.add_argument("--stream-shares", default="",
                    help="moeplug rows per --moe-cache-stream share (of each layer's misses, the GPU computes the "
                         "hottest experts' share beside the CPU), e.g. 0,0.5; default: one row, the plan's flags")
    ap.add_argument("--row-env", default="", help="moeplug rows per value of an environment variable of llama-bench, "
                    "e.g. GGML_CUDA_EXPERT_COPY_AHEAD_BLOCKS=unset,64 ('unset': as the caller's)")
    ap.add_argument("--threads", "-t", type=int, help="threads (default: llama.cpp's)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="npz trace or replay file")
    ap.add_argument("--train-prompts", default="0:400", help="trace prompts moeplug's profile is made of")
    ap.add_argument("--replay-prompts", default="400:", help="trace prompts the batches replay (held out)")
    ap.add_argument("--no-replay-weights", action="store_true", help="replay the experts only, weights from the router")
    ap.add_argument("--prebuilt-moeplug", type=Path, help="bin/ folder of a patched build (skip building)")
    ap.add_argument("--backend", choices=("cpu", "cuda"), help="build to make (default: CUDA where there is a GPU)")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0, help="seconds after which no round starts (0: none)")
    ap.add_argument("--json", type=Path, help="also write every sample and the tables here")
    a = ap.parse_args(argv)
    try:
        budgets = parse_budgets(a.budgets)
        ks = parse_ks(a.ks)
        depths = sorted({int(d) for d in a.depths.split(",") if d.strip()})
    except ValueError as exc:
        ap.error(str(exc))
    if a.reps < 1 or a.rounds < 1 or a.draft_ms < 0 or any(d < 0 for d in depths):
        ap.error("--reps and --rounds must be at least 1, --draft-ms and --depths not negative")
    shares = stream_shares(ap, a.stream_shares)
    envs = row_envs(ap, a.row_env)

    t0 = time.time()
    patched = build_of(a.prebuilt_moeplug, False, a.backend, a.jobs)
    bench_bin = patched.binary("llama-bench")
    model = prepare_model(a)
    info = inspect_model(model)
    got = replay_inputs(model, a)
    if isinstance(got, str):
        print(f"spec_curve: {got}", file=sys.stderr)
        return 1
    profile_path, replay, _ = got
    profile = read_profile(profile_path)
    free = free_vram_or_say("VRAM budgets (running as a CPU smoke test: slots in RAM, no VRAM)")
    # llama-bench takes no --moe-cache-device: the slots in RAM through the engine's debugging override
    slots_env = {"LLAMA_MOE_CACHE_DEVICE": "CPU"} if free is None else {}
    ctx = max(depths) + max(ks)
    load = ["-lm", "none"] if free is not None else []  # pinned weights, as both servers load them on a GPU
    need = gpu_need(patched.binary("llama-fit-params"), model, ctx) if free is not None else None

    rows: list[Row] = []
    pairs: list[tuple[Row, Row]] = []
    for label, value, fraction in budgets:
        budget = budget_bytes(info, ctx, value, fraction, need)
        label = label if not fraction else f"{label} ({budget / GIB:.2f} GiB)"
        fitt = fit_targets(budget, free)
        plan = plan_for(info, PlanRequest(ctx, budget, policy=a.policy), profile_path,
                        build=patched)
        args = ["-ngl", "99", *load, *placement_args(info, plan.slots_per_layer, profile, profile_path,
                                                     plan.cache_policy)]
        stock = Row(label, "stock", ["-fitt", fitt, *load], desc="--fit")
        for share, env in ((s, e) for s in shares for e in envs):
            share = share if share is not None else (plan.stream_share or None)  # None: the plan's own share
            # llama-bench takes the share from the environment (LLAMA_MOE_CACHE_STREAM), not a flag
            stream = {"LLAMA_MOE_CACHE_STREAM": f"{share:g}"} if share is not None else {}
            mine = Row(label, "moeplug", args, {**slots_env, **stream, **env},
                       f"{describe_slots(plan.slots_per_layer, info.n_expert)}, {plan.cache_policy}"
                       + (f", stream {share:g}" if share is not None else "") + env_desc(env))
            print(f"# {label}: moeplug {' '.join(f'{k}={v}' for k, v in stream.items())} {' '.join(mine.args)} | "
                  f"stock {' '.join(stock.args)}", file=sys.stderr)
            rows.append(mine)
            pairs.append((mine, stock))
        rows.append(stock)

    interleaved_rounds(rows, a.rounds, lambda row: run_row(bench_bin, model, row, ks, depths, a.reps, replay, a.threads),
                       t0 + a.time_limit if a.time_limit else None, "llama-bench runs")
    curve = curve_table(pairs, ks, depths)
    speed = speedup_table(pairs, depths, a.draft_ms / 1e3)
    print(f"\n{info.arch}, {len(info.layers)} MoE layers x {info.n_expert} experts ({info.n_expert_used} used), "
          f"{info.total_bytes / GIB:.2f} GiB; replay {replay.name}; free VRAM "
          f"{'none (CPU)' if free is None else f'{free / GIB:.1f} GiB'}; build {patched.build_id}; "
          f"{time.time() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps({"curve": curve, "speculation": speed,
                                      "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
