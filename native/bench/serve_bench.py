"""Server-level benchmark: moeplug's plan, served as `moeplug serve` serves it, against stock
llama-server `--fit on` at the same VRAM budget, on text, recorded routing and random tokens.

    python native/bench/serve_bench.py --shape qwen3-30b-a3b --budgets 8,12,16 --workloads text,random
    python native/bench/serve_bench.py --shape gpt-oss-20b --budgets 25%,50% --workloads replay,text \\
        --trace ../shared/data/traces/gpt-oss-20b/decode-routing-mmlu.npz --train-prompts 0:400 --replay-prompts 400:

For each budget (GiB; `N%`: the planner's other VRAM plus N% of the model's expert bytes; `A+B`: GiB
on each of two GPUs, moeplug splitting the layers as it plans them, stock --fit given a -fitt per
GPU) and
each server configuration, one llama-server is launched per round through moeplug's own library
(`moeplug.operations.install.plan_for` -> `Plan.server_args` -> `moeplug.serving.launch.launch_verified`, exactly what
`moeplug serve` runs, with --metrics), the workload's prompts are sent one by one to
`/completion` (greedy, no prompt cache, `ignore_eos`), and it is stopped again. Before them, after
the launch's context probe (one prompt batch, no decoding), `--warmup N` unmeasured requests (default
1: 32 random tokens, 16 generated) take the first decoding steps on both sides alike: the first
measured prompt used to pay them (in run `2026-12-02-refit-planner-spec` it decoded about 20% slower than the
rest on moeplug's side, 4-15% on stock's):

  moeplug   the plan's flags and environment on the patched build (a profile of the bundled text
            prompts for the text and random workloads; for the replay workload, a profile of the
            trace's training prompts, `moeplug profile --from-trace`); `--copy-ahead on,off` adds a
            row planned for prompt batches that copy their expert weights one at a time (the second
            weight copy's compute buffer given to slots, --moe-cache-copy-ahead off)
  stock     stock llama-server `--fit on -fitt (free VRAM - budget)` from a stock build, with the
            same context, load mode (-lm), threads and parallel slots. llama.cpp's estimate leaves out
            some of what its server holds (154-172 MiB over 8-16 GiB budgets on the H200):
            `--stock-vram budget` raises -fitt before the rounds, a launch at a time, until stock
            holds no more than the budget too (`fit,budget`: both stock rows). `--stock-binary patched`
            runs stock's flags on the patched build instead; under each table a line names the build
            stock's rows ran and whether it was unpatched (the JSON's rows: `stock_build`)

Workloads: `text` (the bundled profiling prompts, profiles/codeish.txt and chatty.txt, and
profiles/heldout.txt, which profiling never sees: code in other languages, prose, German, French, Chinese, repetitive text),
`replay` (both servers run `--moe-route-replay` with the same replay file of the held-out
prompts: every request takes the file's next prompt, the launch's context probe and the warm-up
requests the first ones on both sides alike; the trace is split by prompt, never by token),
`random` (uniformly random token ids), `chat` (not by default: each unseen prompt cut in three
turns, a conversation: each turn sent after the last answer, the conversation so far as the prompt
with llama-server's prompt cache on, so a turn prefills its new text alone, on slots that followed
the turns before; a table row's prompts are turns). Per prompt: prefill and decode t/s from
llama-server's `timings` (`--prefill-reps N`: a text or random prompt's prefill is the median of N
requests per launch: the decoding one, then N - 1 passes over the workload's prompts with requests
of one token, so that no prompt is timed right after itself (where a workload has more than one),
whose routing a dynamic policy's slots would then follow; the order in the JSON, `sequence`; each
prompt's first request alone on a line under the table); per server run: the VRAM the process
holds (NVML; null without a GPU) and the slot hit rate from `/metrics`. Rows run interleaved in
rounds (bench.interleaved_rounds: every other round reversed; `--time-limit S` starts no round that
would end later than S seconds after the start). One markdown table per workload: per budget the median over prompts of the
per-prompt ratio moeplug/stock (each prompt's t/s is its median over rounds), the lowest
per-prompt ratio, the VRAM and the measured hit rate; under it, the median ratio's 95% interval over
the run's rounds (`ratio_interval`: each prompt's rounds drawn again with replacement; it cannot see
what parts whole runs on fresh machines, which can be more), each side's share of prefill
requests delayed more than 15 ms past their prompt's fastest (`delayed`), and each side's decode round
by round, the median over the prompts (`per_round`: a server process that ran slow in every prompt).

The replay workload needs a build whose llama-server lists --moe-route-replay; a stock build
never does (the flag is ours), so there the stock rows run on the patched build with stock flags
(the patches are opt-in: without the cache flags it runs stock's code). On a CPU build (no NVIDIA
GPU) it runs as a smoke test: the moeplug side holds its slots in RAM (LLAMA_MOE_CACHE_DEVICE=CPU,
as the demo does), stock --fit has nothing to fit, VRAM is null.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import GIB, MIB, Prebuilt, free_vram_or_say, interleaved_rounds, median  # noqa: E402
from moeplug.serving.measure import (CHAT_TURNS, SHORT_STEPS, chat_turns, median_ratio_interval, opening_turn,  # noqa: E402
                             round_medians, short_steps, time_chat, time_prompts, time_together, together_groups)
from moeplug.profile.runner import HELDOUT_PROMPT_SET, resolve_prompt_set  # noqa: E402

HERE = Path(__file__).resolve().parent
UNSEEN_PROMPTS = resolve_prompt_set(HELDOUT_PROMPT_SET)[1]  # the bundled set profiling never runs
WARMUP_TOKENS, WARMUP_PREDICT = 32, 16  # a warm-up request's prompt and generated tokens
DEFAULT_TRACE = HERE.parents[1] / ".." / "shared" / "data" / "traces" / "gpt-oss-20b" / "decode-routing-mmlu.npz"
REPLAY_FLAG = "--moe-route-replay"
CACHE_FLAG = "--moe-cache-slots"  # a llama-server that lists it is a patched build
WORKLOADS = ("text", "chat", "concurrent", "replay", "random")
TABLE_ORDER = ("text-profiled", "text-unseen", "chat", "concurrent", "replay", "random")  # a run's tables, in this order
TABLES = {"text-profiled": "text: the bundled profiling prompts (profiles/*.txt)",
          "text-unseen": "text: prompts profiling never sees (profiles/heldout.txt)",
          "chat": f"chat: each unseen prompt as a conversation of {CHAT_TURNS} turns, each turn sent after the last "
                  "answer with the server's prompt cache, so it prefills its new text alone (a prompt here is a turn)",
          "concurrent": "concurrent: the unseen prompts in groups sent at once (--streams), on as many parallel slots; "
                        "a prompt here is a group: prefill its prompts' tokens over the longest prompt's time, decode its "
                        "generated tokens over the wall time the group waited, prompts included",
          "replay": "trace replay: held-out prompts of the trace, moeplug planned from its training prompts",
          "random": "random token ids"}


GPU_DEVICE = re.compile(r"CUDA\d+$")  # a GPU's buffers in the log (CUDA_Host: pinned host memory)


@dataclass
class Config:
    """One server configuration: launched once per round, serving some workloads."""

    budget: str
    side: str  # "moeplug" or "stock"
    binary: Path
    build_id: str
    server_args: list[str]
    workloads: list[str]
    env: dict[str, str] = field(default_factory=dict)
    desc: str = ""
    # (workload, prompt index) -> each round's (prefill, decode, short answer's decode or None) t/s
    samples: dict[tuple[str, int], list[tuple[float, float, float | None]]] = field(default_factory=dict)
    prompt_tokens: dict[tuple[str, int], int] = field(default_factory=dict)  # the prompt's prefilled tokens (prompt_n)
    # chat: (workload, turn index) -> the whole conversation's tokens up to that turn (tokens_evaluated), of which
    # the prompt cache held all but prompt_n
    context_tokens: dict[tuple[str, int], int] = field(default_factory=dict)
    # (workload, prompt index) -> each round's prefill t/s of every request (--prefill-reps), the median in samples
    prefill_reps: dict[tuple[str, int], list[list[float]]] = field(default_factory=dict)
    vram: list[int | None] = field(default_factory=list)  # NVML, per round
    log_vram_mib: list[float] = field(default_factory=list)  # CUDA buffers the log names, and the cache's slots
    buffers: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> device -> MiB, as the log names them
    hits: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # workload -> (hits, selections) per round
    drafts: dict[str, list[int]] = field(default_factory=dict)  # workload -> [drafted, accepted] over every round
    sequence: list[list[str]] = field(default_factory=list)  # each round's measured requests in order: "workload/i:n_predict"
    errors: list[str] = field(default_factory=list)
    plan: dict[str, Any] | None = None  # a moeplug row's plan (Plan.to_json()): its VRAM figures beside NVML's
    warmed: int = 0  # warm-up requests answered, over every round (not measured)
    vram_cap: int | None = None  # a stock row whose -fitt is raised until it holds no more (bytes; --stock-vram budget)
    fit_tries: list[dict[str, Any]] = field(default_factory=list)  # that calibration's launches: -fitt and NVML's bytes
    # a stock row's build: "stock" (unpatched), "patched" (stock's flags on the patched build: --stock-binary
    # patched, or the replay workload, whose flag is ours) or None (a moeplug row, or a run written before)
    stock_binary: str | None = None


def parse_budgets(text: str) -> list[tuple[str, float | list[float], bool]]:
    """'8,12,16' (GiB), '25%,50%' (of the expert bytes) or '8+8,12+12' (GiB per GPU, two GPUs):
    (label, value, is_fraction); a per-GPU budget's value is the list of its GiB."""
    out: list[tuple[str, float | list[float], bool]] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            if "+" in item:
                per_gpu = [float(v) for v in item.split("+")]
                if len(per_gpu) != 2 or min(per_gpu) <= 0:
                    raise ValueError
                out.append((f"{item} GiB", per_gpu, False))
            else:
                out.append((item, float(item[:-1]) / 100, True) if item.endswith("%") else (f"{item} GiB", float(item), False))
        except ValueError:
            raise ValueError(f"--budgets: {item!r} is neither GiB (8), a share of the expert bytes (25%) nor "
                             f"GiB for each of two GPUs (8+8)") from None
    return out


def fit_targets(budget: int | list[int], free: int | None) -> str:
    """stock's -fitt for a budget (moeplug.planner.server_flags.fit_target: per GPU for a list; 0 without a GPU, free
    None, the CPU smoke test)."""
    from moeplug.planner.server_flags import fit_target
    from moeplug.machine.gpu import gpus

    if free is None:
        return fit_target(budget, [])
    return fit_target(budget, [g.free_bytes for g in gpus()] if isinstance(budget, list) else [free])


def budget_bytes(info, ctx: int, value: float | list[float], fraction: bool, need=None, spec=None,
                 draft_need=None) -> int | list[int]:
    """Bytes of VRAM; a fraction buys that share of the expert bytes beside what the planner puts
    on the GPU anyway (weights, KV cache, buffers and margin: llama.cpp's own estimate where
    llama-fit-params saw a GPU, need, else moeplug's; and a speculative draft's weights, KV cache
    and buffers)."""
    from moeplug.planner.plan import make_plan
    from moeplug.planner.request import MachineFacts, PlanRequest

    if isinstance(value, list):
        return [int(v * GIB) for v in value]
    if not fraction:
        return int(value * GIB)
    p = make_plan(info, PlanRequest(ctx, 1 << 50, spec=spec), MachineFacts(need=need, draft_need=draft_need))
    other = p.non_expert_vram_bytes + p.kv_cache_bytes + p.compute_bytes + p.margin_bytes
    draft = p.draft_weights_bytes + p.draft_kv_cache_bytes + p.draft_compute_bytes
    return int(other + draft + value * info.expert_bytes)


def lists_flag(binary: Path, flag: str) -> bool:
    r = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return flag in r.stdout + r.stderr


def build_of(prebuilt: Path | None, stock: bool, backend: str | None, jobs: int):
    from moeplug.native.build import build, resolve_options

    return Prebuilt(prebuilt) if prebuilt else build(resolve_options(backend, stock=stock, jobs=jobs, cuda_arch=None))


def vocab_size(model: Path) -> int:
    """Tokens of the model's vocabulary (the random workload draws from all of them)."""
    import gguf

    from moeplug.model.inspect import shard_paths

    field = gguf.GGUFReader(shard_paths(model)[0]).get_field("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else 32000


def make_prompts(a: argparse.Namespace, n_vocab: int, n_replay: int) -> dict[str, list[Any]]:
    from moeplug.profile.runner import DEFAULT_PROMPT_SETS, read_prompts, resolve_prompt_set

    rng = np.random.default_rng(a.seed)
    cap = (lambda xs: xs[: a.max_prompts]) if a.max_prompts else (lambda xs: xs)
    sets = [read_prompts(resolve_prompt_set(name)[1]) for name in DEFAULT_PROMPT_SETS]
    profiled = [p for group in itertools.zip_longest(*sets) for p in group if p]  # alternating: a cap takes both
    return {
        "text-profiled": cap(profiled),
        "text-unseen": cap(read_prompts(UNSEEN_PROMPTS)),
        "chat": cap([chat_turns(p) for p in read_prompts(UNSEEN_PROMPTS)]),
        "concurrent": together_groups(cap(read_prompts(UNSEEN_PROMPTS)), a.streams),
        "random": [rng.integers(0, n_vocab, a.random_tokens).tolist() for _ in range(a.random_prompts)],
        # token ids do not steer the router here: the replay file does
        "replay": cap([rng.integers(0, n_vocab, a.replay_prompt_tokens).tolist() for _ in range(n_replay)]),
    }


def run_config(cfg: Config, model: Path, ctx: int, prompts: dict[str, list], n_predict: int,
               warmup: list[list[int]] | None = None, prefill_reps: int = 1, keep_logs: Path | None = None) -> None:
    """One round of one configuration: launch, the warm-up requests (not measured), every prompt of
    its workloads, VRAM, stop. prefill_reps: a text or random prompt's prefill is the median of the
    decoding request's and prefill_reps - 1 requests of one token (moeplug.serving.measure; a replayed request
    takes the replay file's next prompt, so replay prompts are sent once, as chat turns are).
    keep_logs: copy the server's log there once it stopped (kept_log_path names it)."""
    from moeplug.core.errors import MoeplugError
    from moeplug.machine.gpu import process_vram_bytes
    from moeplug.serving.metrics import fetch_cache_counters
    from moeplug.serving.launch import launch_verified, stop

    name = f"serve-bench-{os.getpid()}"
    started = time.time()
    try:
        srv = launch_verified(name, model, cfg.binary, cfg.build_id, cfg.server_args, ctx, env=cfg.env, metrics=True)
    except MoeplugError as exc:
        cfg.errors.append(str(exc))
        print(f"# {cfg.budget} {cfg.side}: could not serve: {exc}", file=sys.stderr)
        return
    try:
        cfg.warmed += warm_up(srv.url, warmup, cfg.errors)
        sent: list[str] = []
        cfg.sequence.append(sent)
        for w in cfg.workloads:
            before = fetch_cache_counters(srv.port)
            if w == "chat":
                got = time_chat(srv.url, prompts[w], n_predict)
            elif w == "concurrent":
                got = time_together(srv.url, prompts[w], n_predict)
            else:
                # replay: each request takes the replay file's next prompt, so one request a prompt
                got = time_prompts(srv.url, prompts[w], n_predict, prefill_reps if w != "replay" else 1,
                                   short_steps(n_predict) if w != "replay" else 0)
            record(cfg, w, got, sent)
            after = fetch_cache_counters(srv.port)
            if before is not None and after is not None:
                cfg.hits.setdefault(w, []).append((after.hits - before.hits, after.selections - before.selections))
        cfg.vram.append(process_vram_bytes(srv.pid))
        cache = srv.cache or {}
        cfg.buffers = srv.buffers
        cfg.log_vram_mib.append(sum(mib for kind in srv.buffers.values() for dev, mib in kind.items()
                                    if GPU_DEVICE.match(dev))
                                + (cache.get("mib_uploaded", 0.0) if str(cache.get("device", "")).startswith("CUDA")
                                   else 0.0))
    finally:
        stop(name)
        if keep_logs is not None:
            shutil.copyfile(srv.log, kept_log_path(keep_logs, cfg))
    print(f"# {cfg.budget:>8} {cfg.side:<8} {'+'.join(cfg.workloads):<32} {time.time() - started:5.0f} s",
          file=sys.stderr)


def kept_log_path(folder: Path, cfg: Config) -> Path:
    """Where --keep-logs puts a round's server log: budget, side, row and round in the name, a
    number added where two rows describe themselves alike."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{cfg.budget}-{cfg.side}-{cfg.desc}-{'+'.join(cfg.workloads)}").strip("-")
    folder.mkdir(parents=True, exist_ok=True)
    path, n = folder / f"{slug}-r{len(cfg.sequence)}.log", 1
    while path.exists():
        n += 1
        path = folder / f"{slug}-{n}-r{len(cfg.sequence)}.log"
    return path


def warm_up(url: str, warmup: list[list[int]] | None, errors: list[str]) -> int:
    """The unmeasured warm-up requests; how many were answered (what failed goes to errors)."""
    import requests

    from moeplug.core.errors import MoeplugError
    from moeplug.serving.client import complete

    answered = 0
    for i, prompt in enumerate(warmup or []):
        try:
            complete(url, prompt, WARMUP_PREDICT, ignore_eos=True)
            answered += 1
        except (MoeplugError, requests.RequestException, KeyError, ValueError) as exc:
            errors.append(f"warm-up {i}: {type(exc).__name__}: {exc}")
    return answered


def fit_within(cfg: Config, model: Path, ctx: int, warmup: list[list[int]] | None) -> None:
    """--stock-vram budget: cfg's -fitt raised until its server holds no more than cfg.vram_cap
    (moeplug.operations.bench.fit_within), each launch as a round's (the context probe, the warm-up), in
    cfg.fit_tries; still over the cap, an error of the row. Without NVML's count (no GPU) one launch,
    nothing changed."""
    from moeplug.operations.bench import fit_within as raise_until_within
    from moeplug.core.errors import MoeplugError
    from moeplug.machine.gpu import process_vram_bytes
    from moeplug.serving.launch import launch_verified, stop

    assert cfg.vram_cap is not None
    name = f"serve-bench-fit-{os.getpid()}"

    def held_by(args: list[str]) -> int | None:
        fitt = args[args.index("-fitt") + 1]
        srv = launch_verified(name, model, cfg.binary, cfg.build_id, args, ctx, env=cfg.env)
        try:
            warm_up(srv.url, warmup, cfg.errors)
            held = process_vram_bytes(srv.pid)
        finally:
            stop(name)
        print(f"# {cfg.budget} stock -fitt {fitt}: holds {'?' if held is None else f'{held / MIB:.0f}'} MiB of "
              f"{cfg.vram_cap / MIB:.0f}", file=sys.stderr)
        cfg.fit_tries.append({"fitt": int(fitt), "held_bytes": held})
        return held

    try:
        raise_until_within(cfg.server_args, cfg.vram_cap, held_by)
    except MoeplugError as exc:
        cfg.errors.append(str(exc))


def record(cfg: Config, w: str, got: Any, sent: list[str]) -> None:
    """One launch's timings of workload w (moeplug.serving.measure.Timings) into cfg."""
    sent += [f"{w}/{x}" for x in got.sent]
    cfg.errors += [f"{w} {e}" for e in got.errors]
    for e in got.errors:
        print(f"# {cfg.budget} {cfg.side}: {w} {e}", file=sys.stderr)
    for i, t in got.prompts.items():
        cfg.samples.setdefault((w, i), []).append((t.prefill_median, t.decode, t.decode_short))
        cfg.prefill_reps.setdefault((w, i), []).append(t.prefill)
        cfg.prompt_tokens[(w, i)] = t.prompt_tokens
        if t.context_tokens is not None:
            cfg.context_tokens[(w, i)] = t.context_tokens
        if t.drafted:
            d = cfg.drafts.setdefault(w, [0, 0])
            d[0] += t.drafted
            d[1] += t.accepted


def per_prompt(cfg: Config, workload: str, test: int) -> dict[int, float]:
    """prompt index -> median over rounds of its t/s (test 0 prefill, 1 decode, 2 a short answer's decode:
    the prompts that have it)."""
    return {i: median(x) for i, x in timed(cfg, workload, test).items()}


def timed(cfg: Config, workload: str, test: int) -> dict[int, list[float]]:
    """prompt index -> each round's t/s of test (per_prompt), where it was timed (a JSON of a run before the
    short answers has two values a sample)."""
    out = {i: [s[test] for s in v if len(s) > test and s[test] is not None]
           for (w, i), v in cfg.samples.items() if w == workload}
    return {i: x for i, x in out.items() if x}


def first_prefill(cfg: Config, workload: str) -> dict[int, float]:
    """prompt index -> median over rounds of its first request's prefill t/s (the decoding one, sent
    after another prompt's decoding request), where it was timed more than once (--prefill-reps)."""
    return {i: median([r[0] for r in v]) for (w, i), v in cfg.prefill_reps.items()
            if w == workload and v and max(len(r) for r in v) > 1}


def ratios(mine: Config, stock: Config, workload: str, test: int) -> list[float]:
    a, b = per_prompt(mine, workload, test), per_prompt(stock, workload, test)
    return [a[i] / b[i] for i in sorted(a) if i in b and b[i] > 0]


def first_ratios(mine: Config, stock: Config, workload: str) -> list[float]:
    a, b = first_prefill(mine, workload), first_prefill(stock, workload)
    return [a[i] / b[i] for i in sorted(a) if i in b and b[i] > 0]


def turn_ratios(mine: Config, stock: Config, opening: bool, test: int = 0) -> list[float]:
    """The chat workload's prefill (test 0) or decode (1) ratios of its opening turns (a new conversation:
    it meets the slots another conversation's turns left, and prefills in full) or of its later turns
    (on slots that followed the turns before; their new text alone)."""
    a, b = per_prompt(mine, "chat", test), per_prompt(stock, "chat", test)
    return [a[i] / b[i] for i in sorted(a) if i in b and b[i] > 0 and opening_turn(i) == opening]


def spread(cfg: Config, workload: str, test: int) -> float | None:
    """How far one server's own rounds part: over the prompts it ran in two rounds or more, the
    lowest of a prompt's slowest t/s over its fastest (None with one round). A per-prompt ratio
    against the other side is a median of as many samples, so this is the floor it can fall to
    from noise alone."""
    parts = [min(x[test] for x in v) / max(x[test] for x in v) for (w, _), v in cfg.samples.items()
             if w == workload and len(v) > 1 and max(x[test] for x in v) > 0]
    return min(parts) if parts else None


def per_round(cfg: Config, workload: str, test: int) -> list[float]:
    """Round by round, the median over the workload's prompts of their t/s: how one server process as a
    whole ran, which each prompt's median over rounds hides. On the H200 one process of a row could
    run 10-20% faster or slower than the next in all its prompts alike, so two rows whose rounds
    overlap are not told apart however their medians differ."""
    return round_medians([[s[test] for s in v] for (w, _), v in cfg.samples.items() if w == workload])


SLOW_REQUEST_MS = 15.0  # a prefill request this much slower than its prompt's fastest counts as delayed


def delayed_share(cfg: Config, workload: str) -> list[float] | None:
    """[share of the decoding requests, share of the repeats] whose prefill took more than
    SLOW_REQUEST_MS longer than the fastest request of the same prompt in this configuration (None
    without repeats). The H200 runs showed a second mode ~28 ms above the first on both sides, on
    7% of decoding requests and 13-14% of one-token repeats, far more often in some calls than
    others (`native/bench/results/2026-12-03-prefill-16gib/`): the median of a prompt's requests hides it unless
    it hits most of them."""
    seen = [[0, 0], [0, 0]]
    for (w, i), rounds in cfg.prefill_reps.items():
        n = cfg.prompt_tokens.get((w, i))
        if w != workload or not n or not rounds or max(len(r) for r in rounds) < 2:
            continue
        ms = [[1000.0 * n / x for x in r if x > 0] for r in rounds]
        if not any(ms):
            continue
        best = min(min(r) for r in ms if r)
        for r in ms:
            for j, t in enumerate(r):
                seen[min(j, 1)][0] += t - best > SLOW_REQUEST_MS
                seen[min(j, 1)][1] += 1
    return [a / b for a, b in seen] if seen[1][1] else None


def ratio_interval(mine: Config, stock: Config, workload: str, test: int) -> list[float] | None:
    """The median per-prompt ratio's 95% interval over the run's rounds (moeplug.serving.measure.median_ratio_interval:
    each prompt's rounds drawn again on each side; seeded, so a JSON's tables print the same again)."""
    a, b = timed(mine, workload, test), timed(stock, workload, test)
    return median_ratio_interval([(a[i], b[i]) for i in sorted(a) if i in b])


def ratio_summary(r: list[float]) -> dict[str, float | None]:
    """The median and the lowest of per-prompt ratios (None for none)."""
    return {"ratio_median": statistics.median(r) if r else None, "ratio_lowest": min(r) if r else None}


def hit_rate(cfg: Config, workload: str) -> float | None:
    h = cfg.hits.get(workload) or []
    sel = sum(s for _, s in h)
    return sum(x for x, _ in h) / sel if sel else None


def _mib(cfg: Config) -> str:
    """NVML's count for the process; where NVML does not list it (another PID namespace), what the
    log says the server put on the GPU (its buffers and the cache's slots), marked 'log'; else null."""
    known = [v for v in cfg.vram if v is not None]
    if known:
        return f"{max(known) / MIB:.0f}"
    logged = [v for v in cfg.log_vram_mib if v > 0]
    return f"log {max(logged):.0f}" if logged else "null"


def model_check(mine: Config, row: dict[str, Any]) -> dict[str, Any] | None:
    """The planner's model against the run: per decoded token and per prompt token, moeplug's time
    less stock's as measured (from the row's median t/s) and as the plan modelled it (host time of its
    placement against stock's own placement at the same budget, so the GPU's own time, the same on
    both sides, cancels; decode without the prompt batches the plan also weighs, less the streamed
    misses' modelled saving). None for a row without a plan or with speculation (the model is per
    verification step there); no decode figure where the row streams another share than the plan."""
    plan = mine.plan or {}
    if plan.get("modelled_host_ms") is None or plan.get("speculation"):
        return None
    args = mine.server_args
    shares = [float(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--moe-cache-stream"]
    same_share = (shares[-1] if shares else 0.0) == plan.get("stream_share", 0.0)
    w = plan.get("prefill_weight", 0.0)
    ours, theirs = plan.get("modelled_prompt_us"), plan.get("stock_modelled_prompt_us")
    p, d = row["prefill"], row["decode"]
    out: dict[str, Any] = {}
    if same_share and d["moeplug_tps"] > 0 and d["stock_tps"] > 0:
        host = plan["modelled_host_ms"] - w * (ours or 0.0) / 1e3 - plan.get("modelled_stream_saving_ms", 0.0)
        stock_host = plan["stock_modelled_host_ms"] - w * (theirs or 0.0) / 1e3
        out["decode_ms"] = {"measured": 1e3 / d["moeplug_tps"] - 1e3 / d["stock_tps"], "modelled": host - stock_host}
    if ours is not None and theirs is not None and p["moeplug_tps"] > 0 and p["stock_tps"] > 0:
        out["prefill_us"] = {"measured": 1e6 / p["moeplug_tps"] - 1e6 / p["stock_tps"], "modelled": ours - theirs}
    return out or None


def model_text(r: dict[str, Any]) -> str:
    """One line for a row's model_check."""
    said = [f"{label} {m[key]['measured']:+.{prec}f} {unit} measured, {m[key]['modelled']:+.{prec}f} {unit} modelled"
            for m in [r["model"]] for key, label, unit, prec in (("decode_ms", "decode per token", "ms", 2),
                                                                  ("prefill_us", "prefill per prompt token", "us", 1))
            if key in m]
    return (f"{r['budget']}, {r['moeplug']}: the planner's model against this run, moeplug's time less stock's "
            f"(modelled: host time against stock's own placement at the budget): {'; '.join(said)}")


def measured(mine: Config, stock: Config, workload: str, test: int) -> dict[str, Any]:
    """A row's figures for test (0 prefill, 1 decode, 2 a short answer's decode): each side's median over the
    prompts, the per-prompt ratios' median and lowest, and the median's interval over the rounds."""
    return {"moeplug_tps": median(list(per_prompt(mine, workload, test).values())),
            "stock_tps": median(list(per_prompt(stock, workload, test).values())),
            **ratio_summary(ratios(mine, stock, workload, test)),
            "ratio_interval": ratio_interval(mine, stock, workload, test)}


def stock_build(stock: Config) -> dict[str, Any]:
    """The build a stock row ran: its id, and whether that was the patched build with stock's flags. A run
    written before rows said so is read from the build's id (moeplug's ids name the kind: -moeplug- or
    -stock-; None where it names neither)."""
    if stock.stock_binary is not None:
        patched = stock.stock_binary == "patched"
    else:
        patched = True if "-moeplug-" in stock.build_id else False if "-stock-" in stock.build_id else None
    return {"build_id": stock.build_id, "patched": patched}


def binary_kind(binary: Path) -> str:
    """"patched" for a llama-server that lists the cache's flag (ours), else "stock"."""
    return "patched" if lists_flag(binary, CACHE_FLAG) else "stock"


def stock_build_text(workload: str, rows: list[dict[str, Any]]) -> list[str]:
    """One line per build the table's stock rows ran: unpatched, or the patched build with stock's flags."""
    out = []
    for build in {r["stock_build"]["build_id"]: r["stock_build"] for r in rows if r.get("stock_build")}.values():
        if build["patched"]:
            why = " (the replay flag is ours: no stock build has it)" if workload == "replay" else ""
            out.append(f"stock's side ran the patched build {build['build_id']} with stock's flags{why}, not an "
                       f"unpatched llama.cpp (without the cache's flags its patches stay unused)")
        elif build["patched"] is False:
            out.append(f"stock's side ran {build['build_id']}: unpatched llama.cpp of the same pin")
        else:
            out.append(f"stock's side ran {build['build_id']} (this run's JSON does not say whether it was patched)")
    return out


def table_rows(pairs: list[tuple[Config, Config]], workload: str) -> list[dict[str, Any]]:
    rows = []
    for mine, stock in pairs:
        if workload not in mine.workloads:
            continue
        row: dict[str, Any] = {"budget": mine.budget, "moeplug": mine.desc, "stock": stock.desc,
                               "prompts": len(per_prompt(mine, workload, 0))}
        for test, key in ((0, "prefill"), (1, "decode")):
            row[key] = measured(mine, stock, workload, test)
        # a new prompt's prefill alone: the slots it meets followed another prompt's decoding, where the repeats'
        # follow requests of one token (None without repeats)
        first = first_ratios(mine, stock, workload)
        row["prefill_first"] = ratio_summary(first) if first else None
        # a short answer's decode alone: the first tokens after a new prompt, on slots that followed another (None
        # where the workload's answers are short themselves, and for replay)
        row["decode_short"] = measured(mine, stock, workload, 2) | {"steps": SHORT_STEPS} \
            if ratios(mine, stock, workload, 2) else None
        if workload == "chat":
            for test, key in ((0, "prefill"), (1, "decode")):
                row[f"{key}_opening"], row[f"{key}_later"] = (ratio_summary(turn_ratios(mine, stock, opening, test))
                                                              for opening in (True, False))
        row["delayed"] = {side: delayed_share(cfg, workload) for side, cfg in (("moeplug", mine), ("stock", stock))}
        row["spread"] = {side: {key: spread(cfg, workload, test) for test, key in ((0, "prefill"), (1, "decode"))}
                         for side, cfg in (("moeplug", mine), ("stock", stock))}
        row["per_round"] = {side: {key: per_round(cfg, workload, test) for test, key in ((0, "prefill"), (1, "decode"))}
                            for side, cfg in (("moeplug", mine), ("stock", stock))}
        row["vram_mib"] = {"moeplug": _mib(mine), "stock": _mib(stock)}
        row["hit_rate"] = hit_rate(mine, workload)
        row["drafts"] = {"moeplug": mine.drafts.get(workload), "stock": stock.drafts.get(workload)}
        row["errors"] = mine.errors + stock.errors
        row["stock_build"] = stock_build(stock)
        row["model"] = model_check(mine, row)  # None with speculation, the only rows against another stock
        rows.append(row)
    return rows


def print_table(workload: str, rows: list[dict[str, Any]]) -> None:
    def ratio(d: dict[str, Any]) -> str:
        if d["ratio_median"] is None:
            return "-"
        return f"{d['ratio_median']:.2f}x (lowest {d['ratio_lowest']:.2f}x)"

    print(f"\n### {workload}: {TABLES[workload]}\n")
    print("| budget | moeplug | prompts | prefill t/s moeplug / stock | prefill vs stock | decode t/s moeplug / stock "
          "| decode vs stock | VRAM MiB moeplug / stock | slot hit rate |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        p, d = r["prefill"], r["decode"]
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        versus = f" vs stock {r['stock']}" if r["stock"] != "--fit" else ""
        print(f"| {r['budget']} | {r['moeplug']}{versus} | {r['prompts']} | {p['moeplug_tps']:.1f} / {p['stock_tps']:.1f} "
              f"| {ratio(p)} | {d['moeplug_tps']:.1f} / {d['stock_tps']:.1f} | {ratio(d)} "
              f"| {r['vram_mib']['moeplug']} / {r['vram_mib']['stock']} | {hit} |")
        for e in r["errors"]:
            print(f"\n(failed: {e})")
    for line in stock_build_text(workload, rows):
        print(f"\n{line}")
    for r in rows:
        sp = r["spread"]
        if sp["stock"]["prefill"] is not None and sp["moeplug"]["prefill"] is not None:
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: round to round, one prompt's slowest over "
                  f"its fastest, lowest: prefill moeplug {sp['moeplug']['prefill']:.2f}x, stock "
                  f"{sp['stock']['prefill']:.2f}x; decode moeplug {sp['moeplug']['decode']:.2f}x, stock "
                  f"{sp['stock']['decode']:.2f}x")
    for r in rows:
        rounds = r.get("per_round") or {}
        if all(len(rounds.get(side, {}).get("decode", [])) > 1 for side in ("moeplug", "stock")):
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: decode t/s round by round (median over the "
                  f"prompts): moeplug {', '.join(f'{x:.1f}' for x in rounds['moeplug']['decode'])}; stock "
                  f"{', '.join(f'{x:.1f}' for x in rounds['stock']['decode'])}")
    for r in rows:
        late = r.get("delayed") or {}
        if late.get("moeplug") and late.get("stock"):
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: prefill requests more than "
                  f"{SLOW_REQUEST_MS:g} ms over their prompt's fastest, decoding / one-token ones: moeplug "
                  f"{100 * late['moeplug'][0]:.0f}% / {100 * late['moeplug'][1]:.0f}%, stock "
                  f"{100 * late['stock'][0]:.0f}% / {100 * late['stock'][1]:.0f}%")
    for r in rows:
        iv = [r[k].get("ratio_interval") for k in ("prefill", "decode")]
        if all(iv):
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: the median ratio's 95% interval over this "
                  f"run's rounds (each prompt's rounds drawn again): prefill {iv[0][0]:.2f}x-{iv[0][1]:.2f}x, decode "
                  f"{iv[1][0]:.2f}x-{iv[1][1]:.2f}x")
    for r in rows:
        if (f := r.get("prefill_first")) is not None:
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: prefill of each prompt's first request "
                  f"alone (its decoding one; the table's median pools the repeats): {ratio(f)}")
    for r in rows:
        if (d := r.get("decode_short")) is not None:
            iv = f", 95% interval {d['ratio_interval'][0]:.2f}x-{d['ratio_interval'][1]:.2f}x" if d["ratio_interval"] else ""
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: decode of short answers alone ({d['steps']} "
                  f"tokens to each prompt, on the slots another prompt left): {d['moeplug_tps']:.1f} / "
                  f"{d['stock_tps']:.1f} t/s, {ratio(d)}{iv}")
    for r in rows:
        if (o := r.get("prefill_opening")) is not None and o["ratio_median"] is not None:
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: the opening turns alone (a new "
                  f"conversation, on the slots another one left): prefill {ratio(o)}, decode "
                  f"{ratio(r['decode_opening'])}; the later turns: prefill {ratio(r['prefill_later'])}, decode "
                  f"{ratio(r['decode_later'])}")
    for r in rows:
        if r["model"] is not None:
            print("\n" + model_text(r))
    for r in rows:
        d = r["drafts"]
        if d["moeplug"] or d["stock"]:
            said = [f"{side} {n[1]} of {n[0]}" for side, n in d.items() if n]
            print(f"\n{r['budget']}, {r['moeplug']} vs stock {r['stock']}: drafted tokens accepted: {', '.join(said)}")


def record_rows(pairs: list[tuple[Config, Config]], workload: str) -> list[dict[str, Any]]:
    """Per moeplug row that records (--moe-cache-record), the per-prompt t/s ratios against the row
    of the same budget and policy that does not: what recording costs, side by side in one run."""
    rows = []
    mine = [m for m, _ in pairs if workload in m.workloads]
    for rec in (m for m in mine if "--moe-cache-record" in m.server_args):
        plain = next((m for m in mine if m.budget == rec.budget and m.desc == rec.desc.removesuffix("+record")), None)
        if plain is None:
            continue
        row: dict[str, Any] = {"budget": rec.budget, "moeplug": plain.desc}
        for test, key in ((0, "prefill"), (1, "decode")):
            row[key] = ratio_summary(ratios(rec, plain, workload, test))
        rows.append(row)
    if rows:
        print(f"\n### {workload}: recording's cost, with --moe-cache-record / without (per-prompt ratios)\n")
        print("| budget | moeplug | prefill | decode |")
        print("|---|---|---:|---:|")
        for r in rows:
            cells = [f"{r[k]['ratio_median']:.3f}x (lowest {r[k]['ratio_lowest']:.3f}x)"
                     if r[k]["ratio_median"] is not None else "-" for k in ("prefill", "decode")]
            print(f"| {r['budget']} | {r['moeplug']} | {cells[0]} | {cells[1]} |")
    return rows


def speculation(a: argparse.Namespace, model: Path):
    """(moeplug's Speculation for --spec, or None; the synthetic-acceptance flags both sides add).
    draft:shape writes a draft of the model's shape cut to 2 blocks (same vocabulary) beside it,
    draft:small one of 1 block with as many experts as it uses."""
    from moeplug.planner.speculation import parse_spec
    from moeplug.model.synth import make_model, shape_spec

    if a.spec is None:
        return None, []
    text = a.spec
    if text in ("draft:shape", "draft:small"):
        base = shape_spec(a.shape, seed=99)
        # shape: 2 blocks of the model's own; small: 1 block whose few experts are all used, 8-bit
        # weights where the model's are 16-bit, the output tied to the embeddings where the
        # architecture allows (what a small draft holds)
        spec_d = replace(base, layers=2) if text == "draft:shape" else \
            replace(base, layers=1, experts=base.used, tied=True,
                    dtype="q8_0" if base.dtype in ("f16", "f32") else base.dtype)
        draft = model.with_name(f"{a.shape}-draft-{'2' if text == 'draft:shape' else 'small'}.gguf")
        if not draft.exists():
            print(f"# writing the draft model {draft}", file=sys.stderr)
            make_model(spec_d, draft)
        text = f"draft:{draft}"
    spec = parse_spec(text, a.spec_draft_max)
    rates = [] if a.spec_accept is None else ["--spec-synth-rates",
                                             ",".join(f"{a.spec_accept ** i:.6f}" for i in range(1, spec.n_draft + 1))]
    return spec, rates


def prepare_model(a: argparse.Namespace) -> Path:
    from moeplug.model.synth import make_model, shape_spec

    model = a.model or Path(f"/tmp/moeplug-bench/{a.shape}-shape.gguf")
    if not model.exists():
        print(f"# writing the {a.shape} shape to {model}", file=sys.stderr)
        make_model(shape_spec(a.shape), model)
    return model


def text_profile(model: Path, patched, a: argparse.Namespace) -> Path:
    """The bundled prompts' profile, as `moeplug install` makes it (cached beside the model)."""
    from moeplug.profile.runner import DEFAULT_PROMPT_SETS, ProfileRun, run_profile

    dest = model.with_suffix(f".text-n{a.profile_tokens}.profile.gguf")
    if not dest.exists():
        run = ProfileRun(tool=patched.binary("llama-moe-profile"), model=model, n_predict=a.profile_tokens, ctx=2048,
                         threads=a.threads)
        run_profile(run, list(DEFAULT_PROMPT_SETS), dest)
    return dest


def replay_inputs(model: Path, a: argparse.Namespace) -> tuple[Path, Path, int] | str:
    """(trace profile, replay file of the held-out prompts, their number), or why there is no replay."""
    from moeplug.core.errors import MoeplugError
    from moeplug.profile.format import write_profile
    from moeplug.profile.from_trace import profile_from_trace
    from moeplug.profile.trace import load_trace, write_replay

    if not a.trace.exists():
        return f"no trace at {a.trace} (--trace)"
    try:
        trace = load_trace(a.trace)
        profile = profile_from_trace(trace.select(a.train_prompts), model)
        held_out = trace.select(a.replay_prompts)
    except MoeplugError as exc:
        return str(exc)
    tag = f"{a.train_prompts}-{a.replay_prompts}".replace(":", "_")
    prof_path = model.with_suffix(f".trace-{tag}.profile.gguf")
    write_profile(profile, prof_path)
    replay = write_replay(held_out, model.with_suffix(f".replay-{tag}.gguf"), weights=not a.no_replay_weights)
    return prof_path, replay, held_out.n_prompts


def number_list(ap: argparse.ArgumentParser, flag: str, text: str, example: str, ok: Any, rule: str
                ) -> list[float | None]:
    """A comma-separated list of numbers each ok() accepts ([None], the plan's own, when empty);
    otherwise ap.error's one line."""
    try:
        values: list[float | None] = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: {text!r}: give numbers, e.g. {example}")
    if not all(ok(v) for v in values):
        ap.error(f"{flag}: {rule}")
    return values or [None]


def stream_shares(ap: argparse.ArgumentParser, text: str) -> list[float | None]:
    """--stream-shares: a moeplug row per share of each layer's misses the GPU computes ([None]: the plan's)."""
    return number_list(ap, "--stream-shares", text, "0,0.5", lambda s: 0.0 <= s <= 1.0, "each share from 0 to 1")


ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def row_envs(ap: argparse.ArgumentParser, text: str) -> list[dict[str, str]]:
    """--row-env NAME=V1,V2: a moeplug row per value of one environment variable of its process
    ('unset': the variable left as the plan's environment sets it, else as the caller's; the plan's own
    value is written out to time without it, e.g. GGML_SCHED_EXPERT_COPY_AHEAD=1); [{}] when empty. The
    plan's short-prompt threshold is a flag: --row-args 'none;--moe-cache-offload-min-batch 0' times it against
    llama.cpp's own."""
    if not text:
        return [{}]
    name, eq, values = text.partition("=")
    parts = [v.strip() for v in values.split(",")]
    if not eq or not ENV_NAME.fullmatch(name) or not all(parts):
        ap.error(f"--row-env: {text!r}: give NAME=V1,V2, e.g. GGML_CUDA_EXPERT_COPY_AHEAD_BLOCKS=unset,64")
    return [{} if v == "unset" else {name: v} for v in parts]


def server_env(ap: argparse.ArgumentParser, text: str) -> dict[str, str]:
    """--env NAME=V[,NAME=V]: environment variables of every server, stock's and moeplug's."""
    env = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, eq, value = part.partition("=")
        if not eq or not ENV_NAME.fullmatch(name) or not value:
            ap.error(f"--env: {part!r}: give NAME=VALUE, e.g. GGML_SCHED_TIMELINE=64")
        env[name] = value
    return env


def copy_aheads(ap: argparse.ArgumentParser, text: str) -> list[bool | None]:
    """--copy-ahead on,off,auto: a moeplug row per choice (None: the planner's; [None] when empty)."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if any(x not in ("on", "off", "auto") for x in parts):
        ap.error(f"--copy-ahead: {text!r}: give on, off, auto or a list of them, e.g. auto,off")
    return [None if x == "auto" else x == "on" for x in parts] or [None]


def row_args(ap: argparse.ArgumentParser, text: str, flag: str = "--row-args") -> list[list[str]]:
    """--row-args 'none;--no-op-offload': a moeplug row per set of extra server flags ('none': no extra);
    [[]] when empty. flag: the option's name in the errors (--stock-args takes the same form)."""
    if not text:
        return [[]]
    sets = []
    for part in text.split(";"):
        try:
            words = shlex.split(part)
        except ValueError as exc:
            ap.error(f"{flag}: {part!r}: {exc}")
        if not words:
            ap.error(f"{flag}: {text!r}: an empty set; write none for a row without extra flags")
        if words != ["none"] and not words[0].startswith("-"):
            ap.error(f"{flag}: {part!r}: flags of llama-server, e.g. none;--no-op-offload")
        sets.append([] if words == ["none"] else words)
    return sets


def stock_thread_counts(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """--stock-threads 0,8: a stock row per thread count (0: llama.cpp's default); [] when empty."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--stock-threads: {text!r}: thread counts, e.g. 0,8 (0: llama.cpp's default)")
    if any(n < 0 for n in counts) or len(set(counts)) < len(counts):
        ap.error(f"--stock-threads: {text!r}: distinct counts of 0 or more (0: llama.cpp's default)")
    return counts


def env_desc(env: dict[str, str]) -> str:
    """A row's --row-env value for its description ('' for none)."""
    return "".join(f", {k}={v}" for k, v in env.items())


def configs_from_json(doc: dict[str, Any]) -> tuple[list[Config], list[tuple[Config, Config]]]:
    """The configurations of a run's JSON (--json) and the pairs its tables compare: each moeplug row
    against the stock rows of its budget and workloads written together before it (--stock-vram
    fit,budget writes two), and against stock without speculation too where the run had one
    (--spec-baseline)."""
    known = {f.name for f in fields(Config)}
    configs: list[Config] = []
    pairs: list[tuple[Config, Config]] = []
    theirs: dict[tuple[str, str], list[Config]] = {}
    baseline: dict[tuple[str, str], Config] = {}
    for d in doc["configs"]:
        keyed = {name: {(k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])): v for k, v in d.get(name, {}).items()}
                 for name in ("samples", "prompt_tokens", "prefill_reps", "context_tokens")}
        keyed["samples"] = {k: [tuple(x) for x in v] for k, v in keyed["samples"].items()}
        cfg = Config(**({k: v for k, v in d.items() if k in known} | keyed | {"binary": Path(d["binary"])}))
        group = (cfg.budget, "+".join(cfg.workloads))
        if cfg.side == "stock" and cfg.desc.endswith(", no speculation"):
            baseline[group] = cfg
        elif cfg.side == "stock":
            last = configs[-1] if configs else None
            together = last is not None and last.side == "stock" and (last.budget, "+".join(last.workloads)) == group
            theirs[group] = [*theirs[group], cfg] if together else [cfg]
            baseline.pop(group, None)
        else:
            pairs += [(cfg, t) for t in theirs[group]] + ([(cfg, baseline[group])] if group in baseline else [])
        configs.append(cfg)
    return configs, pairs


def print_tables(pairs: list[tuple[Config, Config]], workloads: list[str]) -> dict[str, Any]:
    """Every workload's table (and its recording rows), printed; the tables as the JSON keeps them."""
    tables = {}
    for w in TABLE_ORDER:
        if w in workloads:
            tables[w] = table_rows(pairs, w)
            print_table(w, tables[w])
            if recorded := record_rows(pairs, w):
                tables[f"{w}/record"] = recorded
    return tables


def main(argv: list[str] | None = None) -> int:
    from moeplug.planner.fit_estimate import gpu_need
    from moeplug.planner.server_flags import SLOTS_IN_RAM_ARGS
    from moeplug.operations.install import draft_need_for, plan_for
    from moeplug.planner.request import PlanRequest
    from moeplug.model.inspect import inspect_model
    from moeplug.planner.record import describe_slots

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "gpt-oss-20b"), help="synthetic model shape written when --model is missing "
                    "(moeplug dev make-model --shape)")
    ap.add_argument("--model", type=Path, help="the model (default /tmp/moeplug-bench/SHAPE-shape.gguf, written)")
    ap.add_argument("--budgets", default="8,12,16", help="VRAM budgets: GiB (8,12,16) or shares of the expert bytes "
                    "beside the rest of the plan's VRAM (25%%,50%%)")
    ap.add_argument("--workloads", default="text,replay,random", help=f"of {', '.join(WORKLOADS)} (chat: not by default)")
    ap.add_argument("--ctx", type=int, default=4096, help="context of both servers")
    ap.add_argument("--threads", "-t", type=int, help="threads of both servers (default: llama.cpp's for stock, the "
                    "plan's for moeplug: half the physical cores where few layers are partly resident)")
    ap.add_argument("--parallel", "-np", type=int, default=1, help="parallel slots of both servers (at least "
                    "--streams with the concurrent workload; one KV cache for all where more than one)")
    ap.add_argument("--streams", type=int, default=4, help="prompts sent at once in the concurrent workload")
    ap.add_argument("--n-predict", "-n", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--max-prompts", type=int, default=0, help="at most this many prompts per text/replay set (0: all)")
    ap.add_argument("--random-prompts", type=int, default=8)
    ap.add_argument("--random-tokens", type=int, default=256, help="prompt length of the random workload")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="npz trace or replay file for the replay workload")
    ap.add_argument("--train-prompts", default="0:400", help="trace prompts moeplug's profile is made of")
    ap.add_argument("--replay-prompts", default="400:", help="trace prompts the servers replay (held out)")
    ap.add_argument("--replay-prompt-tokens", type=int, default=64, help="prompt length of a replayed request")
    ap.add_argument("--no-replay-weights", action="store_true", help="replay the experts only, weights from the router")
    ap.add_argument("--profile-tokens", type=int, default=256, help="tokens per prompt of the text profile")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-weights", default="",
                    help="moeplug rows per planner prefill weight (prompt tokens per generated token), e.g. 0,1 "
                         "(default: the planner's)")
    ap.add_argument("--stream-shares", default="",
                    help="moeplug rows per --moe-cache-stream share (of each layer's misses, the GPU computes the "
                         "hottest carrying this share from host memory), e.g. 0,0.4 (default: the plan's)")
    ap.add_argument("--row-env", default="", help="moeplug rows per value of an environment variable of its server, "
                    "e.g. GGML_CUDA_EXPERT_COPY_AHEAD_BLOCKS=unset,64 ('unset': no value of the row's own, so the "
                    "plan's environment's, else the caller's)")
    ap.add_argument("--row-args", default="", help="moeplug rows per set of extra llama-server flags, sets split by "
                    "';', e.g. 'none;--no-op-offload' (none: no extra flags)")
    ap.add_argument("--ubatches", default="", help="moeplug rows per physical batch (-ub) its plan is made for, e.g. "
                    "512,2048 (the compute buffer at each counted in the budget; auto: the planner's choice for "
                    "--prompt-tokens; default: llama.cpp's 512)")
    ap.add_argument("--prompt-tokens", default="", help="moeplug rows per prompt length its plan prices prompt "
                    "batches for, e.g. 0,4096 (moeplug plan --prompt-tokens; 0, the default: the profile's prompts)")
    ap.add_argument("--stock-args", default="", help="stock rows per set of extra llama-server flags, sets split by "
                    "';', e.g. 'none;-ub 2048 -b 2048' (none: no extra flags; every moeplug row against each)")
    ap.add_argument("--stock-threads", default="", help="stock rows per thread count, e.g. 0,8 (0: llama.cpp's default; "
                    "default: --threads, else llama.cpp's)")
    ap.add_argument("--env", default="", help="environment variables of every server, stock's and moeplug's: "
                    "NAME=VALUE[,NAME=VALUE], e.g. GGML_SCHED_TIMELINE=64 (a --row-env value wins on its row)")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy each round's server log here "
                    "(budget-side-row-rN.log; native/bench/timeline.py reads GGML_SCHED_TIMELINE's reports from them)")
    ap.add_argument("--copy-ahead", default="", help="moeplug rows planned with and without a prompt batch's expert "
                    "weights copied ahead (on,off; off: the compute buffer's second weight copy goes to slots and the "
                    "server runs with --moe-cache-copy-ahead off; auto: the planner's choice, the default)")
    ap.add_argument("--prefill-reps", type=int, default=1, help="time each text or random prompt's prefill this many "
                    "times per launch (the decoding request, then passes over the prompts with requests of one token, "
                    "so each meets the slots another prompt left) and take the median: a prompt batch takes tens "
                    "of ms, and one sample per launch resolves a few percent at best")
    ap.add_argument("--policies", default="", help="moeplug rows per slot policy, e.g. static,dynamic (default: the "
                    "plan's own choice, one row); a policy+record row also records live routing counts "
                    "(--moe-cache-record), to measure what recording costs beside the same policy without it")
    ap.add_argument("--time-limit", type=float, default=0, help="seconds from the start after which no round starts "
                    "that would not end in time at the pace of the last one (0: none)")
    ap.add_argument("--spec", help="speculative decoding on both sides, as moeplug's --spec takes it: mtp, ngram, "
                    "draft:PATH, draft:shape (a 2-block model of --shape, same vocabulary, written beside the model) or "
                    "draft:small (1 block whose few experts are all used, output tied where the architecture allows)")
    ap.add_argument("--spec-draft-max", type=int, help="tokens drafted per step (default: llama.cpp's)")
    ap.add_argument("--spec-accept", type=float, help="synthetic acceptance on both sides (llama-server "
                    "--spec-synth-rates a,a^2,...: each drafted token accepted with probability a once the ones "
                    "before it were; benchmarking only, the text is not the model's)")
    ap.add_argument("--spec-baseline", action="store_true", help="with --spec: also stock --fit without "
                    "speculation, each moeplug row against it too")
    ap.add_argument("--stock-vram", default="fit", help="stock rows: fit (--fit on -fitt (free VRAM - budget), as "
                    "users run it: llama.cpp's estimate of its VRAM leaves out some of what the server holds), budget "
                    "(the same with -fitt raised before the rounds, a launch at a time, until the server holds no more "
                    "than the budget: the VRAM moeplug's plan may hold), or fit,budget (both, each moeplug row against "
                    "each)")
    ap.add_argument("--stock-binary", choices=("stock", "patched"), default="stock",
                    help="the build the stock rows run: stock, an unpatched build of the same pin (the default; the "
                         "replay workload excepted, whose flag is ours), or patched, the patched build with stock's "
                         "flags (the patches unused without the cache's flags); the tables say which")
    ap.add_argument("--prebuilt-moeplug", type=Path, help="bin/ folder of a patched build (skip building)")
    ap.add_argument("--prebuilt-stock", type=Path, help="bin/ folder of a stock build (skip building)")
    ap.add_argument("--backend", choices=("cpu", "cuda", "vulkan"),
                    help="builds to make (default: CUDA where there is a GPU; vulkan: the Vulkan builds)")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--seed", type=int, default=7, help="random prompts")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests after each launch (random tokens; "
                    "0: measure from the first request)")
    ap.add_argument("--json", type=Path, help="also write every sample and the tables here")
    ap.add_argument("--build-only", action="store_true", help="build, write the model, its profiles and the replay "
                    "file, then stop (a first call on a cold machine)")
    ap.add_argument("--tables-from", type=Path, metavar="JSON", help="print the tables of a run's --json again, "
                    "with what this version prints under them (runs nothing)")
    a = ap.parse_args(argv)
    if a.tables_from is not None:
        try:
            _, pairs = configs_from_json(json.loads(a.tables_from.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--tables-from: {a.tables_from}: not a serve_bench JSON ({type(exc).__name__}: {exc})")
        print_tables(pairs, [w for w in TABLE_ORDER if any(w in m.workloads for m, _ in pairs)])
        return 0
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if not workloads or any(w not in WORKLOADS for w in workloads):
        ap.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if not 2 <= a.streams <= 64 or a.parallel < 1:
        ap.error("--streams: from 2 to 64; --parallel: at least 1")
    if "concurrent" in workloads:
        a.parallel = max(a.parallel, a.streams)
    if a.rounds < 1 or a.time_limit < 0 or not 0 <= a.warmup <= 16:
        ap.error("--rounds must be at least 1, --time-limit not negative, --warmup from 0 to 16")
    try:
        budgets = parse_budgets(a.budgets)
    except ValueError as exc:
        ap.error(str(exc))
    policies = [p.strip() for p in a.policies.split(",") if p.strip()] or ["auto"]
    weights = number_list(ap, "--prefill-weights", a.prefill_weights, "0,1", lambda w: w >= 0,
                          "each weight must be 0 or more")
    shares = stream_shares(ap, a.stream_shares)
    aheads = copy_aheads(ap, a.copy_ahead)
    if not 1 <= a.prefill_reps <= 32:
        ap.error("--prefill-reps: from 1 to 32")
    envs = row_envs(ap, a.row_env)
    extras = row_args(ap, a.row_args)
    stock_threads = stock_thread_counts(ap, a.stock_threads)
    stock_extras = row_args(ap, a.stock_args, "--stock-args")
    from moeplug.planner.estimates import DEFAULT_UBATCH, MIN_UBATCH

    from moeplug.planner.request import UBATCH_AUTO

    numbers = [u for u in a.ubatches.split(",") if u.strip() != "auto"]
    ubatches = [int(u) if u is not None else DEFAULT_UBATCH for u in
                number_list(ap, "--ubatches", ",".join(numbers), "512,2048,auto",
                            lambda u: u == int(u) and u >= MIN_UBATCH, f"whole numbers of {MIN_UBATCH} or more, or auto")]
    if len(numbers) < len(a.ubatches.split(",")):  # auto: the planner's choice for --prompt-tokens
        ubatches = ([] if not numbers else ubatches) + [UBATCH_AUTO]
    lengths = [int(n) if n is not None else 0 for n in
               number_list(ap, "--prompt-tokens", a.prompt_tokens, "0,4096", lambda n: n == int(n) and n >= 0,
                           "whole numbers, 0 or more")]
    if a.spec is not None and a.spec != "ngram" and max(ubatches) > DEFAULT_UBATCH:
        ap.error(f"--ubatches above {DEFAULT_UBATCH} with --spec {a.spec}: not planned yet (moeplug plan --ubatch)")
    every_env = server_env(ap, a.env)
    from moeplug.operations.bench import STOCK_VRAM
    from moeplug.planner.server_flags import with_threads

    stock_vram = [v.strip() for v in a.stock_vram.split(",") if v.strip()]
    if not stock_vram or any(v not in STOCK_VRAM for v in stock_vram) or len(set(stock_vram)) < len(stock_vram):
        ap.error(f"--stock-vram: {a.stock_vram!r}: fit, budget or fit,budget")
    if "budget" in stock_vram and any(isinstance(value, list) for _, value, _ in budgets):
        ap.error("--stock-vram budget: one GPU's budgets only (NVML counts the process over every GPU)")
    if any(p.removesuffix("+record") not in ("auto", "static", "dynamic") for p in policies):
        ap.error(f"--policies: {a.policies!r}: each of auto, static, dynamic, optionally with +record")
    if a.spec is None and (a.spec_accept is not None or a.spec_baseline or a.spec_draft_max is not None):
        ap.error("--spec-accept, --spec-baseline and --spec-draft-max need --spec")
    if a.spec_accept is not None and not 0.0 <= a.spec_accept <= 1.0:
        ap.error("--spec-accept: a probability from 0 to 1")
    if a.spec_draft_max is not None and a.spec_draft_max < 1:
        ap.error("--spec-draft-max: at least 1")
    if a.spec is not None and a.spec not in ("draft:shape", "draft:small"):
        from moeplug.core.errors import MoeplugError
        from moeplug.planner.speculation import parse_spec

        try:
            parse_spec(a.spec, a.spec_draft_max)
        except MoeplugError as exc:
            ap.error(str(exc))

    t0 = time.time()
    patched = build_of(a.prebuilt_moeplug, False, a.backend, a.jobs)
    stock = build_of(a.prebuilt_stock, True, a.backend, a.jobs) if a.stock_binary == "stock" else patched
    print(f"# builds ready in {time.time() - t0:.0f} s: {patched.build_id}, {stock.build_id}", file=sys.stderr)
    model = prepare_model(a)
    info = inspect_model(model)
    free = free_vram_or_say("VRAM budgets (running as a CPU smoke test: slots in RAM, no VRAM)")
    slots_args = SLOTS_IN_RAM_ARGS if free is None else []

    skipped: dict[str, str] = {}
    replay = None
    if "replay" in workloads:
        if not lists_flag(patched.binary("llama-server"), REPLAY_FLAG):
            skipped["replay"] = f"the patched llama-server does not list {REPLAY_FLAG} (not built into this build)"
        else:
            got = replay_inputs(model, a)
            if isinstance(got, str):
                skipped["replay"] = got
            else:
                replay = got
    for w, why in skipped.items():
        print(f"# {w} workload skipped: {why}", file=sys.stderr)
    stock_replay_bin, stock_replay_id = stock.binary("llama-server"), stock.build_id
    if replay and not lists_flag(stock_replay_bin, REPLAY_FLAG):
        stock_replay_bin, stock_replay_id = patched.binary("llama-server"), patched.build_id  # stock flags, patched build

    n_vocab = vocab_size(model)
    prompts = make_prompts(a, n_vocab, replay[2] if replay else 0)
    plain = [w for w in TABLE_ORDER if w != "replay" and ((w.startswith("text") and "text" in workloads)
                                                          or w in workloads)]
    common = (["-t", str(a.threads)] if a.threads else []) + ["-np", str(a.parallel)] + (["-kvu"] if a.parallel > 1 else [])
    text_prof = text_profile(model, patched, a) if plain else None
    if a.build_only:
        print(f"# ready in {time.time() - t0:.0f} s: builds, {model}, {text_prof}, {replay}", file=sys.stderr)
        return 0
    spec, spec_args = speculation(a, model)
    configs: list[Config] = []
    pairs: list[tuple[Config, Config]] = []
    fit_tool = patched.binary("llama-fit-params")
    need = gpu_need(fit_tool, model, a.ctx) if free is not None else None
    print(f"# llama-fit-params, every routed expert in RAM: {need}", file=sys.stderr)
    draft_need = draft_need_for(spec, a.ctx, fit_tool) if free is not None else None
    if draft_need is not None:
        print(f"# llama-fit-params, the draft model: {draft_need}", file=sys.stderr)
    for label, value, fraction in budgets:
        budget = budget_bytes(info, a.ctx, value, fraction, need, spec, draft_need)
        label = label if not fraction else f"{label} ({budget / GIB:.2f} GiB)"
        fitt = fit_targets(budget, free)
        groups = [(plain, text_prof, [], patched.binary("llama-server"), stock.binary("llama-server"), stock.build_id)]
        if replay:
            groups.append((["replay"], replay[0], [REPLAY_FLAG, str(replay[1])], patched.binary("llama-server"),
                           stock_replay_bin, stock_replay_id))
        for group, profile, extra, mine_bin, stock_bin, stock_id in groups:
            if not group:
                continue
            stock_kind = binary_kind(stock_bin)  # what the binary is, whatever the folder it came from was called
            variants = [(p, w, s, e, c, x, u, n) for p in policies for w in weights for s in shares for e in envs
                        for c in aheads for x in extras for u in ubatches for n in lengths]
            plans = [plan_for(info, PlanRequest(a.ctx, budget, policy=p.removesuffix("+record"), spec=spec,
                                                copy_ahead=c, ubatch=u, prompt_tokens=n).given(prefill_weight=w),
                              profile, build=patched)
                     for p, w, _, _, c, _, u, n in variants]
            load = ["-lm", "none"] if plans[0].load_mode == "pinned" else []
            stock_args = ["-c", str(a.ctx), "--fit", "on", "-fitt", fitt, *load, *common, *extra]
            stocks = []
            for vram, threads, more in itertools.product(stock_vram, stock_threads or [None], stock_extras):
                theirs = Config(label, "stock", stock_bin, stock_id,
                                with_threads(stock_args, threads)  # --stock-threads replaces --threads (0: none)
                                + (spec.server_args(gpu=True) + spec_args if spec else []) + more, group,
                                desc="--fit" + (" within the budget" if vram == "budget" else "")
                                     + ("" if threads is None else f", -t {threads}" if threads else ", default -t")
                                     + (f", {spec.kind}" if spec else "") + (f", {' '.join(more)}" if more else ""),
                                env=dict(every_env),
                                vram_cap=budget if vram == "budget" and free is not None else None,
                                stock_binary=stock_kind)
                configs.append(theirs)
                stocks.append(theirs)
            baseline = None
            if spec and a.spec_baseline:
                baseline = Config(label, "stock", stock_bin, stock_id, stock_args, group, env=dict(every_env),
                                  desc="--fit, no speculation", stock_binary=stock_kind)
                configs.append(baseline)
            for plan, (policy, weight, share, env, _, more, ubatch, length) in zip(plans, variants):
                record = ["--moe-cache-record"] if policy.endswith("+record") else []
                stream = ["--moe-cache-stream", f"{share:g}"] if share is not None else []
                desc = describe_slots(plan.slots_per_layer, info.n_expert)
                desc += f", {plan.cache_policy}{'+record' if record else ''}" if len(policies) > 1 else ""
                desc += f", prefill weight {weight:g}" if len(weights) > 1 else ""
                streamed = share if share is not None else plan.stream_share  # a --stream-shares row overrides the plan
                desc += f", stream {streamed:g}" if len(shares) > 1 or streamed else ""
                own_t = any(w in ("-t", "--threads") for w in more)  # a --row-args -t replaces the plan's
                desc += f", -t {plan.threads}" if plan.threads and not own_t else ""
                desc += env_desc(env)
                desc += (f", -ub {'auto=' if ubatch == UBATCH_AUTO else ''}{plan.ubatch}"
                         if len(ubatches) > 1 or ubatch != DEFAULT_UBATCH else "")
                desc += f", prompts of {length} planned for" if length else ""
                desc += f", {' '.join(more)}" if more else ""
                desc += "" if plan.copy_ahead else ", no copies ahead"
                desc += f", {spec.kind}" if spec else ""
                mine = Config(label, "moeplug", mine_bin, patched.build_id,
                              [*plan.server_args, *(a for a in slots_args if "--moe-cache-device" not in plan.server_args),
                               *record, *stream, *spec_args, *common, *more, *extra], group,
                              {**plan.server_env(), **every_env, **env}, desc,
                              plan=plan.to_json())
                print(f"# {label} {'+'.join(group)}: moeplug {' '.join(mine.server_args)} | stock "
                      f"{' '.join(theirs.server_args)}", file=sys.stderr)
                configs.append(mine)
                pairs += [(mine, theirs) for theirs in stocks]
                if baseline is not None:
                    pairs.append((mine, baseline))

    warm_rng = np.random.default_rng(a.seed + 1)
    warmup = [warm_rng.integers(0, n_vocab, WARMUP_TOKENS).tolist() for _ in range(a.warmup)]
    for cfg in configs:
        if cfg.vram_cap is not None:
            fit_within(cfg, model, a.ctx, warmup)
    interleaved_rounds(configs, a.rounds,
                       lambda cfg: run_config(cfg, model, a.ctx, prompts, a.n_predict, warmup, a.prefill_reps,
                                              a.keep_logs),
                       t0 + a.time_limit if a.time_limit else None, "servers")
    tables = print_tables(pairs, plain + (["replay"] if replay else []))
    for w, why in skipped.items():
        print(f"\n### {w}: skipped: {why}")
    stock_said = (f"stock build {stock.build_id}" if binary_kind(stock.binary("llama-server")) == "stock" else
                  f"stock rows on the patched build {stock.build_id} with stock's flags")
    print(f"\n{info.arch}, {len(info.layers)} MoE layers x {info.n_expert} experts ({info.n_expert_used} used), "
          f"{info.total_bytes / GIB:.2f} GiB; ctx {a.ctx}, -np {a.parallel}, {a.n_predict} tokens per prompt; "
          f"{f'prefill the median of {a.prefill_reps} requests; ' if a.prefill_reps > 1 else ''}"
          f"free VRAM {'none (CPU)' if free is None else f'{free / GIB:.1f} GiB'}; {stock_said}, "
          f"patched {patched.build_id}; {time.time() - t0:.0f} s")
    if a.json:
        doc = {"tables": tables, "skipped": skipped, "configs": [
            asdict(c) | {"binary": str(c.binary), "samples": {f"{w}/{i}": v for (w, i), v in c.samples.items()},
                         "prompt_tokens": {f"{w}/{i}": n for (w, i), n in c.prompt_tokens.items()},
                         "prefill_reps": {f"{w}/{i}": v for (w, i), v in c.prefill_reps.items()},
                         "context_tokens": {f"{w}/{i}": n for (w, i), n in c.context_tokens.items()}}
            for c in configs]}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    failed = any(c.errors for c in configs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
