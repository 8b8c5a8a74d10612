"""`moeplug bench`: an installed model's plan against stock llama.cpp at the same VRAM budget, on
this machine, through llama-server, side by side.

Both servers run the model's own build (without moeplug's flags it runs stock's code: the patches
are opt-in): moeplug's with the plan's flags and environment, exactly as `moeplug serve` starts it;
stock's with `--fit on` and `-fitt` set so that stock may use the plan's budget (the free VRAM less
the budget stays free), the same context and load mode. llama.cpp's estimate of its own VRAM
leaves out some of what its server holds (on an H200, 154-172 MiB over 8-16 GiB budgets): with
`--stock-vram budget` stock's -fitt is first raised, a launch at a time, until it holds no more than
the budget, as moeplug's plan does (fit_within). They take turns, round after round, every
other round in reverse order, so that neither always runs first. Each launch answers a warm-up
request, then the prompts (moeplug.serving.measure): per prompt the ratio of moeplug's t/s to stock's, each
the median over rounds, then the median and the lowest over prompts. Beside a prompt's decode over
its whole answer, where answers are longer than measure.SHORT_STEPS tokens, the decode of a short
answer to it (`decode_short`): the first tokens after a new prompt, on slots that followed another.

Stock means stock: by default stock's server is llama-server of an unpatched build of the same pin,
with the backend, GPU architecture and CPU flags of the model's own build (built once where it is not
there yet); `stock_binary="patched"` runs stock's flags on the model's patched build instead, and the
output says so. Either way the comparison names the build each side ran.

`--against BIN` puts any llama-server the user has (a newer upstream with its own expert cache, ik_llama.cpp,
Ollama's bundled one) in stock's place: the same prompts, rounds and warm-up, the plan's context (-c)
and the user's flags (`--against-args`), and the VRAM each process holds counted the same way (NVML).
That side is named by its binary.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moeplug.core.errors import MoeplugError
from moeplug.planner.estimates import DEFAULT_UBATCH
from moeplug.machine.gpu import gpus, process_vram_bytes
from moeplug.serving.installed import read_installed
from moeplug.operations.install import installed_build, up_to_date
from moeplug.serving.measure import (ERRORS, Timings, chat_turns, median_ratio_interval, opening_turn, round_medians,
                             short_steps, time_chat, time_prompts, time_together, together_groups)
from moeplug.core.paths import logs_dir
from moeplug.profile.runner import HELDOUT_PROMPT_SET, read_prompts, resolve_prompt_set
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.serving.client import REQUEST_ERRORS, complete, tokenize
from moeplug.planner.server_flags import stock_args, with_threads
from moeplug.serving.launch import find_record, launch_verified, model_lock, stop
from moeplug.core.sizes import MIB

SIDES = ("moeplug", "stock")
MEASURES = ("prefill", "first", "decode", "decode_short")  # per prompt, where the workload has it (decode_short)
WARMUP_PREDICT = 16
LONG_PROMPTS = 2  # prompts of the "long" workload (compare's prompt_tokens)
AUTO_PARALLEL = 4  # llama-server's parallel slots where -np is not given (b11434: "auto", 4, one KV cache for all)
FIT_PAD_MIB = 16  # stock held to the budget: MiB added to its -fitt beyond what it held over
STOCK_BINARIES = ("stock", "patched")  # the stock side's build: unpatched of the same pin, or the model's own
AGAINST = "against"  # the other side's key where it is a llama-server the user gave (--against)
MOEPLUG_SETS = ("-m", "--model", "--host", "--port")  # the other server's flags that moeplug sets itself

# `bench --stock-vram`: stock as users run it, or held to the plan's budget (fit_within)
STOCK_VRAM = ("fit", "budget")


def raised_fit_target(fitt: str, held: int, cap: int) -> str:
    """stock's -fitt (MiB left free) raised by the MiB its server held over cap, rounded up, and
    FIT_PAD_MIB more: llama.cpp's estimate of its own VRAM leaves out some of what the process holds
    (154-172 MiB over 8-16 GiB budgets on an H200)."""
    return str(int(fitt) + -(-(held - cap) // MIB) + FIT_PAD_MIB)


def fit_within(args: list[str], cap: int, held_by: Callable[[list[str]], int | None],
               tries: int = 4) -> list[dict[str, Any]]:
    """Stock held to the budget: while a launch of stock's server arguments `args` holds more than
    `cap` bytes, raise their -fitt (raised_fit_target, in place) and launch again. held_by(args)
    launches stock as a measured round would (warm-up included), stops it and returns what it held
    (NVML; None: nothing to go by, and args stay as they are). Returns each launch's -fitt and bytes;
    raises MoeplugError where the last of `tries` launches still held more than cap."""
    i = args.index("-fitt") + 1
    tried: list[dict[str, Any]] = []
    for _ in range(tries):
        held = held_by(args)
        tried.append({"fitt": int(args[i]), "held_bytes": held})
        if held is None or held <= cap:
            return tried
        args[i] = raised_fit_target(args[i], held, cap)
    raise MoeplugError(f"stock --fit still held {tried[-1]['held_bytes'] / MIB:.0f} MiB, over the "
                       f"{cap / MIB:.0f} MiB budget, after {tries} launches with a larger -fitt each time")


def bench_prompts(prompt_files: list[Path], max_prompts: int) -> list[str]:
    """The prompts: those of the files (or bundled set names) given, alternating (a cap takes some of
    each), else the bundled held-out set, which no default profile is made from, so that the plan is
    not timed on the text its slots were chosen for; at most max_prompts (0: all)."""
    if prompt_files:
        sets = [read_prompts(resolve_prompt_set(str(p))[1]) for p in prompt_files]
    else:
        sets = [read_prompts(resolve_prompt_set(HELDOUT_PROMPT_SET)[1])]
    texts = [p for group in itertools.zip_longest(*sets) for p in group if p]
    if not texts:
        raise MoeplugError("no prompts in " + ", ".join(map(str, prompt_files)))
    return texts[:max_prompts] if max_prompts else texts


def tokenized(url: str, texts: list[str]) -> list[list[int]]:
    """The texts as the llama-server at url tokenizes them."""
    try:
        return [tokenize(url, text) for text in texts]
    except REQUEST_ERRORS as exc:
        raise MoeplugError(f"llama-server /tokenize: {exc}") from None


def check_together_fits(url: str, groups: list[list[str]], n_predict: int, ctx: int) -> None:
    """Prompts sent together share the server's one KV cache: each group's prompts and answers must
    fit the context, or the server refuses them mid-run; a one-line error before any is sent."""
    for group in groups:
        need = sum(len(ids) + n_predict for ids in tokenized(url, group))
        if need > ctx:
            raise MoeplugError(f"{len(group)} prompts at once need {need} tokens of context (their prompts and "
                               f"{n_predict} generated each), the plan's is {ctx}: '--concurrent N' fewer, shorter "
                               f"prompts, or a model installed with a larger --ctx")


def long_prompts(url: str, texts: list[str], n_tokens: int, count: int = LONG_PROMPTS) -> list[list[int]]:
    """`count` prompts of exactly n_tokens token ids: the texts as the server tokenizes them, one after
    another from a different text for each prompt, cycled until long enough."""
    ids = tokenized(url, texts)
    if not any(ids):
        raise MoeplugError("the prompts tokenize to nothing: no long prompt can be made of them")
    out = []
    for k in range(count):
        seq: list[int] = []
        i = k
        while len(seq) < n_tokens:
            seq += ids[i % len(ids)]
            i += 1
        out.append(seq[:n_tokens])
    return out


def short_prompts(url: str, texts: list[str], n_tokens: int) -> list[list[int]]:
    """Each text's first n_tokens token ids as the server tokenizes them (a chat's opening line, a short
    request); texts with fewer tokens are left out, and where none has as many, one line says so."""
    ids = [seq[:n_tokens] for seq in tokenized(url, texts) if len(seq) >= n_tokens]
    if not ids:
        raise MoeplugError(f"no prompt is {n_tokens} tokens long: '--short N' fewer")
    return ids


def against_binary(text: str) -> Path:
    """--against BIN: the llama-server program to run (a path, or a name on PATH), or one line saying
    what is wrong with it."""
    path = Path(text).expanduser()
    if not path.exists() and os.sep not in text and shutil.which(text):
        path = Path(shutil.which(text) or text)
    if not path.exists():
        raise MoeplugError(f"--against {text}: no such file")
    if path.is_dir():
        raise MoeplugError(f"--against {text}: a folder, not a llama-server program")
    if not os.access(path, os.X_OK):
        raise MoeplugError(f"--against {text}: not executable (chmod +x, or the llama-server next to it)")
    return path.resolve()


def against_arguments(text: str) -> list[str]:
    """--against-args "...": the other server's flags, split as a shell splits them, or one line saying
    why they do not parse; the model, host and port are moeplug's to set."""
    try:
        args = shlex.split(text)
    except ValueError as exc:
        raise MoeplugError(f"--against-args {text!r}: {exc} (quote them as a shell would)") from None
    taken = [a for a in args if a.split("=", 1)[0] in MOEPLUG_SETS]
    if taken:
        raise MoeplugError(f"--against-args: {', '.join(taken)}: moeplug sets the model, host and port itself")
    return args


def stock_build_for(mine: Any, stock_binary: str, progress: ProgressFn = silent) -> Any:
    """The build the stock side runs (a BuildResult): "patched", the model's own build `mine` (stock's
    flags leave the patches unused); "stock", the unpatched build of this checkout's pin with `mine`'s
    backend, GPU architecture and CPU flags, built now where it is not there yet."""
    if stock_binary not in STOCK_BINARIES:
        raise MoeplugError(f"--stock-binary {stock_binary!r}: one of {', '.join(STOCK_BINARIES)}")
    if stock_binary == "patched":
        return mine
    from moeplug.native.build import BuildOptions, build, build_id, installed_builds
    from moeplug.native.lock import load_spec

    m = mine.manifest
    opts = BuildOptions(backend=m["backend"], stock=True, cuda_arch=m.get("cuda_arch"),
                        cpu_flags=tuple(m.get("cpu_flags", [])))
    spec = load_spec()
    found = {b.build_id: b for b in installed_builds()}.get(build_id(spec, opts))
    if found is not None:
        return found
    progress(Note(f"no unpatched build of llama.cpp {spec.lock.tag} ({opts.backend}) for the stock side yet: building it "
                  f"once ('--stock-binary patched' runs stock's flags on the patched build instead)"))
    return build(opts, spec, progress)


@dataclass
class Launched:
    """A running llama-server of either side: where it answers, its process, what its log said of the cache."""

    url: str
    pid: int
    cache: dict[str, Any] | None = None


def start_other(binary: Path, model: Path, args: list[str], log: Path, env: dict[str, str] | None = None,
                timeout: float = 300) -> Any:
    """A llama-server of the user's (--against), started with the model, a free port on 127.0.0.1 and
    `args` alone (no flag of moeplug's, which another server may not know), healthy; a moeplug Server
    (stop() ends it). One line naming its log where it exits or never answers."""
    from moeplug.serving.server import HOST, Server, free_port

    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", HOST, "--port", str(port), *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env} if env else None)
    srv = Server(proc=proc, port=port, log_path=log, args=argv)
    try:
        srv.wait_healthy(timeout=timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


@dataclass
class Side:
    """One side's launches: its server arguments and environment, and per workload and prompt each
    round's Timed (moeplug.serving.measure)."""

    args: list[str]
    env: dict[str, str]
    timed: dict[str, dict[int, list[Any]]] = field(default_factory=dict)
    binary: str = ""  # the llama-server it ran
    build_id: str | None = None  # moeplug's build id of that binary (None: a llama-server of the user's)
    vram_bytes: list[int | None] = field(default_factory=list)  # NVML, per launch
    cache: list[dict[str, Any] | None] = field(default_factory=list)  # per launch, what its log said of the cache

    def add(self, workload: str, got: Timings) -> None:
        for i, t in got.prompts.items():
            self.timed.setdefault(workload, {}).setdefault(i, []).append(t)

    def samples(self, workload: str, what: str) -> dict[int, list[float]]:
        """prompt -> each round's prefill (the median of its requests), first (its first request's
        prefill), decode or decode_short t/s (the prompts that have it)."""
        pick = {"prefill": lambda t: t.prefill_median, "first": lambda t: t.prefill[0], "decode": lambda t: t.decode,
                "decode_short": lambda t: t.decode_short}
        out = {i: [v for v in map(pick[what], ts) if v is not None] for i, ts in self.timed.get(workload, {}).items()}
        return {i: v for i, v in out.items() if v}

    def per_prompt(self, workload: str, what: str) -> dict[int, float]:
        """prompt -> the median over rounds of samples()."""
        return {i: statistics.median(v) for i, v in self.samples(workload, what).items()}


@dataclass
class Comparison:
    name: str
    budget_bytes: int | list[int] | None
    rounds: int
    n_predict: int
    prefill_reps: int
    workloads: dict[str, list[Any]]  # workload -> its prompts (chat: each a list of turns)
    sides: dict[str, Side]
    notes: list[str] = field(default_factory=list)
    stock_vram: str = "fit"  # STOCK_VRAM
    fit_tries: list[dict[str, Any]] = field(default_factory=list)  # stock held to the budget: each launch's -fitt, bytes
    other: str = "stock"  # the second side's key: "stock", or AGAINST for a llama-server of the user's
    other_label: str = "stock"  # how the output names it: "stock", or the path of the user's llama-server
    stock_binary: str | None = "stock"  # STOCK_BINARIES: which build the stock side ran (None with --against)

    @property
    def names(self) -> tuple[str, str]:
        return ("moeplug", self.other)

    def _summary(self, workload: str, what: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The median and lowest of these rows' ratios, and the median's interval over the rounds."""
        r = [row[what]["ratio"] for row in rows if what in row and row[what]["ratio"] is not None]
        keep = {row["prompt"] for row in rows if what in row}
        mine, theirs = (self.sides[side].samples(workload, what) for side in self.names)
        return {"ratio_median": statistics.median(r) if r else None, "ratio_lowest": min(r) if r else None,
                "ratio_interval": median_ratio_interval([(mine[i], theirs[i]) for i in sorted(mine)
                                                         if i in theirs and i in keep])}

    def rows(self, workload: str) -> list[dict[str, Any]]:
        """Per prompt: tokens prefilled and both sides' t/s with the ratios."""
        mine = self.sides["moeplug"]
        out = []
        other = self.other
        per = {(side, what): self.sides[side].per_prompt(workload, what) for side in self.names for what in MEASURES}
        for i in sorted(per[("moeplug", "prefill")]):
            if i not in per[(other, "prefill")]:
                continue
            first = mine.timed[workload][i][0]  # the tokens: the same every launch on moeplug's side
            row: dict[str, Any] = {"prompt": i, "prompt_tokens": first.prompt_tokens,
                                   **({"context_tokens": first.context_tokens} if first.context_tokens else {})}
            for what in MEASURES:
                if i in per[("moeplug", what)] and i in per[(other, what)]:
                    m, s = per[("moeplug", what)][i], per[(other, what)][i]
                    row[what] = {"moeplug_tps": m, f"{other}_tps": s, "ratio": m / s if s > 0 else None}
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        workloads = {}
        for w in self.workloads:
            rows = self.rows(w)
            summary = {what: self._summary(w, what, rows) for what in MEASURES
                       if what != "decode_short" or any(what in row for row in rows)}
            if w == "chat":
                # a conversation's opening turn prefills in full on the slots another conversation left; the later
                # turns prefill their new text on slots that followed the turns before
                for key, opening in (("opening", True), ("later", False)):
                    turns = [r for r in rows if opening_turn(r["prompt"]) == opening]
                    summary[key] = {what: self._summary(w, what, turns) for what in ("prefill", "decode")}
            # round by round, each side's median over the prompts: a server process that ran slow in all of them
            summary["per_round"] = {side: {what: round_medians(list(self.sides[side].samples(w, what).values()))
                                           for what in ("prefill", "decode")} for side in self.names}
            workloads[w] = {"prompts": len(rows), "rows": rows, **summary}
        return {"name": self.name, "budget_bytes": self.budget_bytes, "rounds": self.rounds,
                "n_predict": self.n_predict, "prefill_reps": self.prefill_reps, "notes": self.notes,
                "stock_vram": self.stock_vram, "fit_tries": self.fit_tries,
                "other": self.other, "other_label": self.other_label,
                # which build the stock side ran: an unpatched one of the pin, or the patched one with stock's flags
                **({"stock_build": {"build_id": self.sides["stock"].build_id, "binary": self.sides["stock"].binary,
                                    "patched": self.stock_binary == "patched"}} if self.other == "stock" else {}),
                **({AGAINST: {"binary": self.sides[AGAINST].binary, "args": self.sides[AGAINST].args}}
                   if self.other == AGAINST else {}),
                "sides": {k: {"args": v.args, "env": v.env, "vram_bytes": v.vram_bytes, "cache": v.cache,
                              "binary": v.binary, "build_id": v.build_id}
                          for k, v in self.sides.items()},
                "workloads": workloads}


@dataclass(frozen=True)
class BenchOptions:
    """What `moeplug bench` weighs (compare; the command's flags say each in full). threads: moeplug's
    CPU threads for the comparison in place of the plan's (0: llama.cpp's default; the installed plan is
    not changed); stock_threads, stock_ubatch: stock's (None: llama.cpp's defaults, as users run it);
    stock_vram "budget": stock's -fitt raised until its server holds no more than the budget (fit_within;
    one GPU). prompt_tokens: also a "long" workload of prompts of that many tokens (None: the plan's
    prompt length, where it has one; 0: none); concurrent: also prompts sent that many at once (0: none);
    short: also each prompt's first `short` tokens (0: none). stock_binary: the build stock's side runs
    (stock_build_for; None: an unpatched build). against: a llama-server of the user's in stock's place
    (against_binary), with the plan's -c and against_args (a shell-quoted string)."""

    rounds: int = 3
    n_predict: int = 64
    prefill_reps: int = 3
    prompt_files: tuple[Path, ...] = ()
    max_prompts: int = 8
    chat: bool = False
    stock_vram: str = "fit"
    threads: int | None = None
    stock_threads: int | None = None
    stock_ubatch: int | None = None
    prompt_tokens: int | None = None
    concurrent: int = 0
    short: int = 0
    stock_binary: str | None = None
    against: str | None = None
    against_args: str | None = None

    def check(self) -> None:
        """One-line errors for options that cannot go together."""
        if self.stock_vram not in STOCK_VRAM:
            raise MoeplugError(f"stock VRAM {self.stock_vram!r}: one of {', '.join(STOCK_VRAM)}")
        if self.against is not None:
            against_binary(self.against)  # a missing or unusable binary, or args that do not parse: said first
            against_arguments(self.against_args or "")
            given = [flag for flag, v in (("--stock-binary", self.stock_binary), ("--stock-threads", self.stock_threads),
                                          ("--stock-ubatch", self.stock_ubatch),
                                          ("--stock-vram budget", self.stock_vram if self.stock_vram != "fit" else None))
                     if v]
            if given:
                raise MoeplugError(f"{', '.join(given)}: the stock side's, which --against replaces with your "
                                   f"llama-server (its flags go in --against-args)")
        elif self.against_args is not None:
            raise MoeplugError("--against-args: the flags of the llama-server --against names; give --against BIN too")
        if self.stock_binary is not None and self.stock_binary not in STOCK_BINARIES:
            raise MoeplugError(f"--stock-binary {self.stock_binary!r}: one of {', '.join(STOCK_BINARIES)}")


def workloads_for(plan: Any, options: BenchOptions) -> tuple[dict[str, list[Any]], int | None]:
    """The prompts of each workload (long and short ones made later, by the first server's tokenizer),
    and the long prompts' length (None: none)."""
    texts = bench_prompts(list(options.prompt_files), options.max_prompts)
    workloads: dict[str, list[Any]] = {"text": texts}
    if options.chat:
        workloads["chat"] = [chat_turns(t) for t in texts]
    long_tokens = plan.prompt_tokens if options.prompt_tokens is None else options.prompt_tokens
    if long_tokens:
        if long_tokens + options.n_predict >= plan.ctx:
            raise MoeplugError(f"prompts of {long_tokens} tokens generating {options.n_predict} do not fit the plan's "
                               f"context of {plan.ctx} tokens: '--prompt-tokens N' for a shorter one, 0 for none")
        workloads["long"] = []
    if options.short:
        workloads["short"] = []
    if options.concurrent:
        workloads["concurrent"] = together_groups(texts, options.concurrent)
    return workloads, long_tokens or None


def sides_for(m: Any, options: BenchOptions, progress: ProgressFn) -> tuple[dict[str, Side], str, str, list[str]]:
    """Both sides' servers (moeplug's plan, and stock's or the user's), the other side's key and label,
    and the notes that say how the two differ."""
    plan, concurrent = m.plan, options.concurrent
    slots = ["-np", str(concurrent), "-kvu"] if concurrent > AUTO_PARALLEL else []
    mine_build = installed_build(m)
    sides = {"moeplug": Side(with_threads(plan.server_args, options.threads) + slots, m.server_env(),
                             binary=str(mine_build.binary("llama-server")), build_id=mine_build.build_id)}
    notes = []
    if options.against is not None:
        other_bin, other_args = against_binary(options.against), against_arguments(options.against_args or "")
        other, other_label = AGAINST, str(other_bin)
        sides[AGAINST] = Side(["-c", str(plan.ctx), *other_args] + slots, {}, binary=str(other_bin))
        if not any(a.split("=", 1)[0] in ("-fitt", "--fit-target", "--moe-cache-mib", "-ngl", "--n-gpu-layers",
                                          "-ncmoe", "--n-cpu-moe", "-ot", "--override-tensor", "--cpu-moe")
                   for a in other_args):
            notes.append(f"{other_bin} ran with -c {plan.ctx} and none of -fitt, -ngl, -ncmoe, -ot, --cpu-moe or "
                         f"--moe-cache-mib: its own defaults decide the VRAM it takes, not the plan's budget (each "
                         f"side's VRAM is counted the same way, per process)")
    else:
        other, other_label = "stock", "stock"
        stock_build = stock_build_for(mine_build, options.stock_binary or "stock", progress)
        stock = stock_args(plan, stock_ubatch=options.stock_ubatch)
        sides["stock"] = Side(with_threads(stock, options.stock_threads) + slots, dict(plan.device_env),
                              binary=str(stock_build.binary("llama-server")), build_id=stock_build.build_id)
        if options.stock_binary == "patched":
            notes.append(f"stock's side ran the patched build {stock_build.build_id} with stock's flags "
                         f"(--stock-binary patched): without the cache's flags the patches stay unused")
    return sides, other, other_label, notes + side_notes(plan, options, slots)


def side_notes(plan: Any, options: BenchOptions, slots: list[str]) -> list[str]:
    """What the two sides' runs differ in besides the placement."""
    notes = []
    if slots:
        notes.append(f"{options.concurrent} parallel slots on both sides (-np {options.concurrent} -kvu) for "
                     f"{options.concurrent} prompts at once, where llama-server has {AUTO_PARALLEL} by default")
    if not gpus():
        notes.append("no NVIDIA GPU: both servers run on the CPU here, so the ratios say nothing of what the "
                     "slots do with VRAM")
    stock_ub = options.stock_ubatch or DEFAULT_UBATCH
    if plan.ubatch != stock_ub:
        notes.append(f"prompt batches of {plan.ubatch} tokens on moeplug's side, {stock_ub} on stock's "
                     f"('--stock-ubatch N' for the same): the prefill ratio of prompts longer than the "
                     f"smaller includes what the batch size gives")
    if plan.speculation:
        notes.append("the plan speculates and stock does not: the decode ratio includes what the drafts give")
    return notes


class Launcher:
    """Starts and stops one side's llama-server at a time for a comparison: moeplug's launches under a
    record of their own (bench-NAME), the user's server (--against) as a plain process."""

    def __init__(self, name: str, m: Any, sides: dict[str, Side], other_label: str, warmup: str,
                 progress: ProgressFn) -> None:
        self.name, self.m, self.sides, self.other_label, self.warmup = name, m, sides, other_label, warmup
        self.progress = progress
        self.launch = f"bench-{name}"
        self.running: list[Any] = []  # the user's llama-server while it runs

    def halt(self) -> None:
        """Stop the side that runs: the user's server, or moeplug's launch record."""
        if self.running:
            self.running.pop().stop()
        else:
            stop(self.launch)

    def who(self, side: str) -> str:
        return self.other_label if side == AGAINST else f"{side} llama-server"

    def start(self, side: str, args: list[str], env: dict[str, str]) -> Launched:
        """side's llama-server, launched and past its warm-up request"""
        s, m = self.sides[side], self.m
        with model_lock(self.name, self.progress):
            if side == AGAINST:
                srv = start_other(Path(s.binary), Path(m.path), args,
                                  logs_dir() / f"server-{self.launch}-against.log", env)
                self.running.append(srv)
                got = Launched(srv.url, srv.proc.pid)
            else:
                rec = launch_verified(self.launch, Path(m.path), Path(s.binary), s.build_id or m.build_id, args,
                                      m.plan.ctx, env=env)
                got = Launched(rec.url, rec.pid, rec.cache)
        try:
            complete(got.url, self.warmup, WARMUP_PREDICT, ignore_eos=True)
        except ERRORS as exc:
            self.halt()
            raise MoeplugError(f"{self.who(side)}, the warm-up request: {type(exc).__name__}: {exc}") from None
        return got

    def held_by(self, args: list[str]) -> int | None:
        """The VRAM a stock server with these flags holds (NVML)."""
        self.progress(Note(f"stock llama-server -fitt {args[args.index('-fitt') + 1]}: the VRAM it holds"))
        srv = self.start("stock", args, {})
        try:
            return process_vram_bytes(srv.pid)
        finally:
            self.halt()


def compare(name: str, options: BenchOptions = BenchOptions(), progress: ProgressFn = silent) -> Comparison:
    """Run an installed model's plan and stock --fit at the same budget in turns (see the module);
    raises where the model is being served (the GPU must be the two servers' alone) or a launch or
    prompt fails."""
    options.check()
    read_installed(name)  # an unknown name fails first
    served = find_record(name)
    if served is not None and served.alive():
        raise MoeplugError(f"'{name}' is being served (pid {served.pid}): 'moeplug stop {name}' first, so that the "
                           f"two servers have the GPU to themselves")
    with model_lock(name, progress):
        m = up_to_date(read_installed(name), progress)  # the plan serve would run
    workloads, long_tokens = workloads_for(m.plan, options)
    sides, other, other_label, notes = sides_for(m, options, progress)
    launcher = Launcher(name, m, sides, other_label, workloads["text"][0], progress)
    fit_tries = held_to_budget(m.plan, sides, options, launcher, notes)
    names = ("moeplug", other)
    for r in range(options.rounds):
        for side in names if r % 2 == 0 else names[::-1]:
            progress(Note(f"round {r + 1} of {options.rounds}: {launcher.who(side)}"))
            run_side(launcher, side, workloads, long_tokens, options, first=r == 0 and side == names[0])
    return Comparison(name, m.plan.vram_budget_bytes, options.rounds, options.n_predict, options.prefill_reps,
                      workloads, sides, notes, options.stock_vram, fit_tries, other, other_label,
                      None if other == AGAINST else options.stock_binary or "stock")


def held_to_budget(plan: Any, sides: dict[str, Side], options: BenchOptions, launcher: Launcher,
                   notes: list[str]) -> list[dict[str, Any]]:
    """stock_vram "budget": stock's -fitt raised until its server holds no more than the budget (its
    flags in sides["stock"] then); each try's -fitt and bytes."""
    if options.stock_vram != "budget":
        return []
    if isinstance(plan.vram_budget_bytes, list):
        raise MoeplugError("stock held to the budget: one GPU's budget only (NVML counts a process over every GPU)")
    if not gpus() or plan.vram_budget_bytes is None:
        notes.append("no NVIDIA GPU: stock is not held to the budget, there is no VRAM to hold it to")
        return []
    return fit_within(sides["stock"].args, plan.vram_budget_bytes, launcher.held_by)


def run_side(launcher: Launcher, side: str, workloads: dict[str, list[Any]], long_tokens: int | None,
             options: BenchOptions, first: bool) -> None:
    """One round of one side: its server launched, every workload timed into its Side, its VRAM and
    cache line kept, the server stopped."""
    s, n_predict = launcher.sides[side], options.n_predict
    texts = workloads["text"]
    srv = launcher.start(side, s.args, s.env)
    try:
        if long_tokens and not workloads["long"]:
            workloads["long"] = long_prompts(srv.url, texts, long_tokens)
        if options.short and not workloads["short"]:
            workloads["short"] = short_prompts(srv.url, texts, options.short)
        if options.concurrent and first:
            check_together_fits(srv.url, workloads["concurrent"], n_predict, launcher.m.plan.ctx)
        for w, prompts in workloads.items():
            got = time_chat(srv.url, prompts, n_predict) if w == "chat" else \
                time_together(srv.url, prompts, n_predict) if w == "concurrent" else \
                time_prompts(srv.url, prompts, n_predict, options.prefill_reps, short_steps(n_predict))
            if got.errors:
                raise MoeplugError(f"{launcher.who(side)}, {w}: {got.errors[0]}")
            s.add(w, got)
        s.vram_bytes.append(process_vram_bytes(srv.pid))
        s.cache.append(srv.cache)
    finally:
        launcher.halt()
