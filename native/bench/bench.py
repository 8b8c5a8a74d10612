"""Side-by-side benchmark of the expert slot cache against stock llama.cpp at emulated VRAM budgets.

Run on a machine with an NVIDIA GPU:

    python native/bench/bench.py [--budgets 8,12,16] [--pp 512] [--tg 128] [--reps 3] [--pp-reps 10] [--rounds 2]

Builds are cached under ~/.local/share/moeplug/builds; on an H200 box (16 cores) the patched one
takes about 4 minutes the first time, the stock one 4-5. With both cached, the table takes 5-6
minutes per load mode and round (fit and cache rows of 3 budgets: about 2.5 minutes a round). One
cold run under 10 minutes: `--no-stock-build --load-modes pinned --rounds 1` (the stock rows on the
patched build without cache flags: the patches are opt-in); a larger run splits by --budgets or
--configs, and `--time-limit S` starts no round that would end more than S seconds after the start.

It builds stock and patched llama.cpp (CUDA), writes the Qwen3-30B-A3B-shaped Q4_K model (16 GiB,
random weights: a near-uniform router, the worst case for any cache), profiles it briefly, and
runs llama-bench for every row in each load mode (mmap; pinned `-lm none`; pinned with
repacking off, `--repack 0`), keeping each test's best mode per row. At each budget B:

  stock --fit        llama-bench -fitt (free VRAM - B): what a user runs today
  stock -ncmoe K     the lowest K whose experts fit the expert VRAM that stock --fit uses at B
  moeplug plan       what moeplug runs for that same expert VRAM (read from llama-fit-params):
                     the planner's slots per layer from the profile, whole layers where the
                     router is flat (offloaded as stock does), hot experts where it is not (the
                     cache, every batch through its slots), the other layers' experts in RAM

plus the bounds: every expert on the CPU (--cpu-moe) and full offload. It prints one markdown
table, pp and tg in tokens/s with the ratio to the best stock row of the same budget, all
measured in this run: the median of every repetition (--reps for decode, --pp-reps for prefill,
whose first repetition in each run is dropped as a warm-up) of every round (± their standard
deviation). The rounds interleave the rows' llama-bench runs (every other round in reverse order):
runs of one configuration differ by more than the repetitions inside one run do (on the H200,
stock --fit decode at 8 GiB gave 70.8, 62.0 and 68.3 t/s in three runs, each ± 1-2), so each row
gets several runs spread over the whole table rather than one. Each ratio also gives, in
parentheses, the lowest and highest ratio of single rounds: there, rows that put the same tensors
on the same devices gave single-round ratios from 0.75x to 1.26x, the resolution of one run.

llama-bench's fit sizes each test for the context it needs (512 for pp512, 128 for tg128), so
a budget buys a little more expert VRAM for decode than for prefill: the expert VRAM, and with
it the -ncmoe and cache rows, is read per test and the two tests run separately where it differs.

The profile is made of uniformly random token ids (llama-moe-profile --random), the workload
llama-bench runs: the benchmark model's own text tokenizer reaches only a few hundred of its
151936 tokens, so a text profile would route differently.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
# one patched build serves bench.py and fidelity.py (the targets are part of a build's identity)
PATCHED_TARGETS = ("llama-bench", "llama-moe-profile", "llama-fit-params", "test-moe-cache")


@dataclass
class Row:
    budget: str
    config: str
    args: list[str]
    stock: bool
    tg_args: list[str] | None = None  # when the decode test needs other arguments than prefill
    # tokens/s of each repetition, one list per llama-bench run (a round) in the order the rounds
    # ran, per (test, load mode)
    runs: dict[tuple[str, str], list[list[float]]] = dataclasses.field(default_factory=dict)

    def add(self, test: str, load: str, values: list[float]) -> None:
        self.runs.setdefault((test, load), []).append(values)

    @property
    def samples(self) -> dict[tuple[str, str], list[float]]:
        """Every repetition of every round, per (test, load mode)."""
        return {key: [v for run in runs for v in run] for key, runs in self.runs.items()}

    def best(self, test: str) -> tuple[str, list[float]]:
        """The load mode with the highest median for this test, and its samples."""
        runs = [(load, v) for (t, load), v in self.samples.items() if t == test and v]
        return max(runs, key=lambda run: statistics.median(run[1]), default=("", []))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _samples(results: list[dict], prefill: bool) -> list[float]:
    """tokens/s of each repetition of the run's prefill or decode test.

    The first prefill repetition is a warm-up and dropped (when there are others): llama-bench's
    own warm-up pass runs the prompt once, yet on a GPU the first timed 512-token batch still pays
    one-time setup (on the H200 with every weight on the GPU: 5756 and 7095 t/s against medians of
    10185 and 10345 of the 14 repetitions after it), which with 3 repetitions moves the median."""
    for x in results:
        if (x["n_prompt"] > 0 and x["n_gen"] == 0) if prefill else (x["n_gen"] > 0 and x["n_prompt"] == 0):
            values = list(x.get("samples_ts") or [x["avg_ts"]])
            return values[1:] if prefill and len(values) > 1 else values
    return []


def llama_bench(binary: Path, model: Path, args: list[str], pp: int, tg: int, reps: int
                ) -> tuple[list[float], list[float]]:
    """tokens/s of each repetition of one llama-bench run, pp and tg (a test of 0 tokens is skipped)."""
    cmd = [str(binary), "-m", str(model), "-p", str(pp), "-n", str(tg), "-r", str(reps), "-fa", "1", "-o", "json", *args]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(f"# failed: {' '.join(cmd)}\n# {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}",
              file=sys.stderr)
        return [], []
    results = json.loads(r.stdout)
    if "--moe-cache-slots" in args and "moe-cache: " in r.stderr:
        print("# " + next(line for line in r.stderr.splitlines() if "moe-cache: " in line), file=sys.stderr)
    return _samples(results, prefill=True), _samples(results, prefill=False)


# mmap is llama.cpp's default; pinned loads weights into pinned host memory (fast uploads for
# prefill); repacking (on by default) changes the CPU kernels' layout, which helps some tests
# and hurts others
LOAD_MODES = {"mmap": [], "pinned": ["-lm", "none"], "pinned-norepack": ["-lm", "none", "--repack", "0"]}


def fit_expert_bytes(fit_params: Path, model: Path, info, margin_mib: int, ctx: int) -> int:
    """Bytes of routed-expert weights that stock --fit keeps on the GPU at this margin.

    llama-bench -fitt fits each test with the context that test needs (n_prompt + n_gen: 512 for
    pp512, 128 for tg128), not -fitc; so the same context is asked for here."""
    r = subprocess.run([str(fit_params), "-m", str(model), "-fitt", str(margin_mib), "-c", str(ctx), "-fa", "on"],
                       capture_output=True, text=True, timeout=300, check=True)
    line = r.stdout.strip().splitlines()[-1]
    m = re.search(r'-ot "?([^"]+)"?', line)
    on_cpu = [re.compile(p.rsplit("=", 1)[0]) for p in m[1].split(",")] if m else []
    print(f"# fit at margin {margin_mib} MiB, ctx {ctx}: {line[:160]}{'...' if len(line) > 160 else ''}",
          file=sys.stderr)
    return sum(t.n_bytes for layer in info.layers for name, t in layer.tensors.items()
               if not any(p.search(f"blk.{layer.block}.{name}") for p in on_cpu))


def run_once(binary: Path, model: Path, row: Row, load: str, pp: int, tg: int, reps: int, pp_reps: int) -> None:
    """The row's llama-bench runs of one round: prefill and decode each in a run of its own, with
    their own repetitions (a prefill repetition takes a tenth of a second, a decode one seconds)."""
    extra = LOAD_MODES[load]
    started = time.time()
    p = llama_bench(binary, model, row.args + extra, pp, 0, pp_reps)[0] if pp else []
    t = llama_bench(binary, model, (row.tg_args or row.args) + extra, 0, tg, reps)[1] if tg else []
    row.add("pp", load, p)
    row.add("tg", load, t)
    print(f"# {row.budget:>6} {row.config:<28} {load:<15} pp {median(p):9.1f} ± {spread(p):6.1f}  "
          f"tg {median(t):7.1f} ± {spread(t):5.1f}  ({time.time() - started:.0f} s)", file=sys.stderr)


def run_rounds(rows: list[Row], binary_of: Callable[[Row], Path], model: Path, loads: list[str], rounds: int,
               pp: int, tg: int, reps: int, pp_reps: int, deadline: float | None = None) -> None:
    """Every row's runs, per load mode, round after round.

    Rounds interleave the rows, so a slow spell of the machine (llama-bench runs of one
    configuration differ by more than the repetitions inside one run do) falls on every row; every
    other round runs them in reverse, so no row always runs right after the same other one.
    deadline (a time.time()): no round starts that would end after it at the pace of the last one
    (every load mode runs at least one round), so every row keeps the same number of rounds."""
    for load in loads:
        interleaved_rounds(rows, rounds, lambda row: run_once(binary_of(row), model, row, load, pp, tg, reps, pp_reps),
                           deadline, load)


def interleaved_rounds(rows: list, rounds: int, run_row: Callable, deadline: float | None = None,
                       label: str = "rows") -> int:
    """run_row(row) for every row, round after round, every other round in reverse order; no round
    starts that would end after deadline (a time.time()) at the pace of the last one (at least one
    round runs). Returns the rounds run. serve_bench.py runs its rows through here too."""
    for i in range(rounds):
        started = time.time()
        for row in rows if i % 2 == 0 else rows[::-1]:
            run_row(row)
        if deadline is not None and i + 1 < rounds and time.time() + (time.time() - started) > deadline:
            print(f"# {label}: {i + 1} of {rounds} rounds, another would pass the time limit", file=sys.stderr)
            return i + 1
    return rounds


def cache_desc(plan, info) -> str:
    partial = [n for n in plan.slots_per_layer if 0 < n < info.n_expert]
    desc = f"{plan.whole_layers} whole layer{'' if plan.whole_layers == 1 else 's'}"
    return desc + (f" + {sum(partial)} slots in {len(partial)}" if partial else "")


def cache_args(plan, info, profile, profile_path: Path) -> list[str]:
    """What moeplug runs for the plan: whole layers offloaded as stock does, the rest's experts in
    RAM, slots for the partly resident layers."""
    from moeplug.planner.server_flags import placement_args

    return ["-ngl", "99", *placement_args(info, plan.slots_per_layer, profile, profile_path)]


def round_ratios(runs: list[list[float]], top_runs: list[list[float]]) -> list[float]:
    """The ratio of medians in each round: both runs of a round ran minutes apart, not a table apart."""
    return [median(a) / median(b) for a, b in zip(runs, top_runs) if a and b and median(b) > 0]


def print_table(rows: list[Row], pp: int, tg: int) -> None:
    """One markdown table: per test the best load mode's median (± standard deviation of all its
    repetitions), and its ratio to the best stock row of the same budget, with the lowest and
    highest of the rounds' own ratios when there are several: how far one run can be trusted."""
    best = {(id(row), test): row.best(test) for row in rows for test in ("pp", "tg")}

    def cell(row: Row, test: str) -> str:
        values = best[id(row), test][1]
        return f"{median(values):.1f} ± {spread(values):.1f}" if values else "-"

    def ratio(row: Row, test: str) -> str:
        peers = [r for r in rows if r.budget == row.budget and r.stock and best[id(r), test][1]]
        if not peers or not best[id(row), test][1]:
            return "-"
        top = max(peers, key=lambda r: median(best[id(r), test][1]))
        text = f"{median(best[id(row), test][1]) / median(best[id(top), test][1]):.2f}x"
        per_round = round_ratios(row.runs[test, best[id(row), test][0]], top.runs[test, best[id(top), test][0]])
        if top is not row and len(per_round) > 1:
            text += f" ({min(per_round):.2f}-{max(per_round):.2f})"
        return text

    print(f"\n| budget | configuration | load (pp, tg) | pp{pp} t/s | tg{tg} t/s | pp vs best stock | tg vs best stock |")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        pp_load, tg_load = best[id(row), "pp"][0], best[id(row), "tg"][0]
        load = pp_load if pp_load == tg_load or not tg_load else f"{pp_load}, {tg_load}"
        print(f"| {row.budget} | {row.config} | {load} | {cell(row, 'pp')} | {cell(row, 'tg')} "
              f"| {ratio(row, 'pp')} | {ratio(row, 'tg')} |")
    if any(len(runs) > 1 for row in rows for runs in row.runs.values()):
        print("\nRatios: medians of every round's repetitions; in parentheses the lowest and highest "
              "ratio of single rounds.")


@dataclass
class Prebuilt:
    bin_dir: Path

    @property
    def build_id(self) -> str:
        return f"prebuilt {self.bin_dir}"

    @property
    def manifest(self) -> dict:
        """The build's build.json beside bin/ (a moeplug build), else nothing."""
        import json

        try:
            return json.loads((self.bin_dir.parent / "build.json").read_text())
        except (OSError, ValueError):
            return {}

    @property
    def backend(self):
        """The backend its manifest names (a folder without one: the CPU's, so that plans keep CUDA's defaults)."""
        from moeplug.machine.backend import backend

        return backend(self.manifest.get("backend"))

    def binary(self, name: str) -> Path:
        return self.bin_dir / name


def cuda_build(stock: bool, targets: tuple[str, ...], jobs: int):
    """A CUDA build of these targets for this machine's GPU, stock or patched (cached)."""
    from moeplug.native.build import build, resolve_options

    opts = resolve_options("cuda", stock=stock, jobs=jobs, cuda_arch=None)
    return build(dataclasses.replace(opts, targets=targets))


def patched_build(prebuilt: Path | None, jobs: int):
    """The patched CUDA build with every target the bench scripts run: a prebuilt bin/ folder, or
    built (cached) for this machine's GPU."""
    return Prebuilt(prebuilt) if prebuilt else cuda_build(False, PATCHED_TARGETS, jobs)


def free_vram_or_say(what: str) -> int | None:
    """Free VRAM in bytes; None, with a line on stderr, where there is no NVIDIA GPU."""
    from moeplug.machine.gpu import free_vram_bytes

    free = free_vram_bytes()
    if free is None:
        print(f"no NVIDIA GPU: {what} needs one", file=sys.stderr)
    return free


def main() -> int:
    from moeplug.model.inspect import inspect_model
    from moeplug.planner.plan import make_plan
    from moeplug.planner.request import MachineFacts, PlanRequest
    from moeplug.profile.format import read_profile
    from moeplug.model.synth import benchmark_spec, make_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="8,12,16", help="emulated card sizes in GiB")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the prefill test (0: no prefill test)")
    ap.add_argument("--tg", type=int, default=128, help="tokens of the decode test (0: no decode test)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions inside one llama-bench run of the decode test")
    ap.add_argument("--pp-reps", type=int, default=10,
                    help="repetitions inside one llama-bench run of the prefill test (the first is dropped as a warm-up)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="llama-bench runs per row and load mode, interleaved with the other rows' runs")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds from the start (builds included) after which no round starts that would not end "
                         "in time at the pace of the last one, so a run fits a machine's time limit (0: none)")
    ap.add_argument("--model", type=Path, default=Path("/tmp/moeplug-bench/qwen3-30b-a3b-shape-q4_k.gguf"))
    ap.add_argument("--no-stock-build", action="store_true",
                    help="run the stock rows on the patched build without cache flags (the patches are opt-in)")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--prebuilt", type=Path, help="a bin/ folder of a patched CUDA build to use instead of building "
                    "(llama-bench, llama-moe-profile, llama-fit-params); implies --no-stock-build")
    ap.add_argument("--configs", default="fit,ncmoe,cache,bounds", help="rows to run: fit, ncmoe, cache, bounds")
    ap.add_argument("--load-modes", default=",".join(LOAD_MODES),
                    help=f"load modes to try per row, of {', '.join(LOAD_MODES)}; each test keeps its best")
    ap.add_argument("--cache-max-batch", default="0",
                    help="--moe-cache-max-batch for the cache rows, one row per comma-separated value (0: "
                    "llama.cpp's default; above it a batch runs the stock graph, every expert of a partly "
                    "resident layer uploaded from RAM)")
    ap.add_argument("--build-only", action="store_true",
                    help="build, write the model and its profile, then stop (a first call on a cold machine)")
    a = ap.parse_args()
    unknown = [m for m in a.load_modes.split(",") if m not in LOAD_MODES]
    if unknown:
        ap.error(f"--load-modes: unknown mode {unknown[0]!r} (known: {', '.join(LOAD_MODES)})")
    if a.reps < 1 or a.pp_reps < 1 or a.rounds < 1:
        ap.error("--reps, --pp-reps and --rounds must be at least 1")
    if a.time_limit < 0:
        ap.error("--time-limit cannot be negative")
    try:
        max_batches = [int(n) for n in a.cache_max_batch.split(",")]
    except ValueError:
        ap.error(f"--cache-max-batch: {a.cache_max_batch!r} is not a comma-separated list of batch sizes")
    if any(n < 0 for n in max_batches):
        ap.error("--cache-max-batch: a batch size cannot be negative")

    t0 = time.time()

    # the model is written while the builds run (one core against the compilers' many)
    writer = None
    if not a.model.exists():
        writer = multiprocessing.Process(target=make_model, args=(benchmark_spec(), a.model))
        writer.start()
    patched = patched_build(a.prebuilt, a.jobs)
    stock = patched if a.prebuilt or a.no_stock_build else cuda_build(True, ("llama-bench",), a.jobs)
    print(f"# builds ready in {time.time() - t0:.0f} s: {patched.build_id}, {stock.build_id}", file=sys.stderr)
    if writer is not None:
        writer.join()
        if writer.exitcode != 0:
            print(f"could not write {a.model} (exit {writer.exitcode})", file=sys.stderr)
            return 1
        print(f"# model written at {time.time() - t0:.0f} s: {a.model}", file=sys.stderr)
    info = inspect_model(a.model)

    profile = a.model.with_suffix(".random.profile.gguf")
    if not profile.exists():
        subprocess.run([str(patched.binary("llama-moe-profile")), "-m", str(a.model), "--random", "16:256",
                        "--out", str(profile), "-n", "32", "-ngl", "99"], check=True, capture_output=True)

    if a.build_only:
        print(f"# ready in {time.time() - t0:.0f} s: builds, {a.model}, {profile}", file=sys.stderr)
        return 0
    free = free_vram_or_say("this benchmark")
    if free is None:
        return 1
    rows: list[Row] = []
    configs = a.configs.split(",")
    profile_doc = read_profile(profile)  # read once for every budget's cache rows
    for b in [float(x) for x in a.budgets.split(",")]:
        budget = int(b * GIB)
        label = f"{b:g} GiB"
        margin_mib = max(0, (free - budget) // MIB)
        # one plan per llama-bench test, for the context llama-bench's own fit gives that test
        plans = {}
        for test, ctx in (("pp", a.pp), ("tg", a.tg)):
            if ctx > 0:  # --pp 0 or --tg 0 skips that test
                room = fit_expert_bytes(patched.binary("llama-fit-params"), a.model, info, margin_mib, ctx)
                plans[test] = make_plan(info, PlanRequest(ctx, budget), MachineFacts(expert_room=room),
                                        profile_path=profile)
                print(f"# {label} {test}: slots per layer {','.join(map(str, plans[test].slots_per_layer))}",
                      file=sys.stderr)
        plans.setdefault("pp", plans.get("tg"))
        plans.setdefault("tg", plans["pp"])
        if "fit" in configs:
            rows.append(Row(label, "stock --fit", ["-fitt", str(margin_mib)], True))
        if "ncmoe" in configs:
            k_pp, k_tg = plans["pp"].stock_ncmoe, plans["tg"].stock_ncmoe
            rows.append(Row(label, f"stock -ncmoe {k_tg}" + (f" (pp: {k_pp})" if k_pp != k_tg else ""),
                            ["-ngl", "99", "-ncmoe", str(k_pp)], True, ["-ngl", "99", "-ncmoe", str(k_tg)]))
        if "cache" in configs and plans["tg"].slots_total > 0:
            pp_desc, tg_desc = cache_desc(plans["pp"], info), cache_desc(plans["tg"], info)
            for n in max_batches:
                flag = ["--moe-cache-max-batch", str(n)] if n else []
                rows.append(Row(label, f"moeplug {tg_desc}" + (f" (pp: {pp_desc})" if pp_desc != tg_desc else "")
                                + (f", max batch {n}" if n else ""),
                                cache_args(plans["pp"], info, profile_doc, profile) + flag, False,
                                cache_args(plans["tg"], info, profile_doc, profile) + flag))
    if "bounds" in configs:
        rows.append(Row("bound", "stock --cpu-moe", ["-ngl", "99", "-ncmoe", str(info.n_layer)], True))
        rows.append(Row("bound", "stock full offload", ["-ngl", "99"], True))
        rows.append(Row("bound", f"cache {info.n_expert}/{info.n_expert} slots (all whole)",
                        ["-ngl", "99", "-ncmoe", str(info.n_layer), "--moe-cache-profile", str(profile),
                         "--moe-cache-slots", str(info.n_expert)], False))

    run_rounds(rows, lambda row: (stock if row.stock else patched).binary("llama-bench"), a.model,
               a.load_modes.split(","), a.rounds, a.pp, a.tg, a.reps, a.pp_reps,
               t0 + a.time_limit if a.time_limit else None)
    print_table(rows, a.pp, a.tg)
    print(f"\n{info.n_layer} layers x {info.n_expert} experts, {info.total_bytes / GIB:.2f} GiB; "
          f"free VRAM {free / GIB:.1f} GiB; stock build {stock.build_id}, patched {patched.build_id}; "
          f"{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
