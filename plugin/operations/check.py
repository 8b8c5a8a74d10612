"""The check at the end of `moeplug install`: the placements this machine could serve, run side by side
on held-out prompts, and the fastest served.

The planner's figures are either measured here (operations.calibrate) or fitted on another machine,
and either can be wrong for this one: on an H100 the plan made with the machine's own figures decoded
slower than the one made with the fitted figures. What settles it is running them. The candidates
(serving.installed.CANDIDATES):

- "plan": the model's plan, made with this machine's figures (its calibration, a file the user named, or
  where there is neither, the fitted ones);
- "fitted": the plan made with the figures fitted on the GPU machine, where its server flags differ;
- "stock": stock --fit's placement at the same budget, through the same binary.

Each runs CHECK_ROUNDS rounds of the bundled held-out prompts (which no default profile is made from),
the order turned every round. They are judged on their speed for the workload the plan is made for:
per prompt and round, generated tokens a second with the plan's prefill_weight prompt tokens
prefilled for each (1 / (1 / decode + prefill_weight / prefill); decode alone where the weight is 0),
over stock's, the median over the prompts. Where the two fastest differ by less than CLOSE and the
rounds do not resolve which is ahead, those two run more rounds, up to CHECK_MAX_ROUNDS. The plan of
the highest speed is served, unless it is below `bar` (1.0 unless the user sets `--check-min`: stock's
placement is faster), then stock's placement through the same binary. The verdict keeps every
candidate's figures, decode and prefill apart too (serving.installed.Verdict); `moeplug bench NAME`
looks closer, `moeplug install MODEL --no-check` serves the plan unchecked.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from moeplug.core.errors import MoeplugError
from moeplug.core.progress import Note, ProgressFn, Step, silent
from moeplug.model.inspect import inspect_model
from moeplug.operations.bench import BenchOptions, Launcher, Side, bench_prompts, run_side
from moeplug.operations.install import installed_build, installed_request, plan_for
from moeplug.planner.costs import GPU_MACHINE, CostModel
from moeplug.planner.record import Plan
from moeplug.planner.request import COSTS_FITTED, COSTS_MACHINE
from moeplug.planner.server_flags import stock_args
from moeplug.serving.installed import Candidate, InstalledModel, Verdict
from moeplug.serving.measure import median_ratio_interval

CHECK_BAR = 1.0  # stock's placement is served where the best plan's speed is below this share of stock's
CHECK_PROMPTS = 4  # held-out prompts each round
CHECK_PREDICT = 48  # tokens each answer decodes
CHECK_ROUNDS = 2  # rounds every candidate runs
CHECK_MAX_ROUNDS = 4  # rounds the two fastest may reach where they are close
CLOSE = 0.05  # two candidates within this share of each other, unresolved, run more rounds
TASK = "checking"


@dataclass
class Contender:
    """A candidate while the check runs: its plan (None for stock's placement), flags and environment."""

    name: str
    plan: Plan | None
    costs: str
    side: Side
    prefill_weight: float = 0.0  # prompt tokens a generated token, as the plan weighs them (mixed)

    def decode(self) -> dict[int, list[float]]:
        return self.side.samples("text", "decode")

    def mixed(self) -> dict[int, list[float]]:
        """Per prompt, each round's generated tokens a second with prefill_weight prompt tokens prefilled for
        each: 1 / (1 / decode + prefill_weight / prefill), the rate the check judges by."""
        out: dict[int, list[float]] = {}
        for i, rounds in self.side.timed.get("text", {}).items():
            rates = [1.0 / (1.0 / t.decode + self.prefill_weight / t.prefill_median) for t in rounds
                     if t.decode and t.prefill_median]
            if rates:
                out[i] = rates
        return out


def plan_summary(plan: Plan) -> str:
    """A plan in a few words: '17 whole layers, 1536 slots, static, 10% streamed'."""
    words = [f"{plan.whole_layers} whole layers", f"{plan.slots_total} slots", plan.cache_policy]
    if plan.stream_share:
        words.append(f"{plan.stream_share:.0%} streamed")
    return ", ".join(words)


def fitted_plan(m: InstalledModel) -> Plan:
    """The installed model's plan made again as it was asked, with the figures fitted on the GPU machine."""
    request = replace(installed_request(m), costs=COSTS_FITTED)
    profile = Path(m.profile) if m.profile and Path(m.profile).exists() else None
    return plan_for(inspect_model(m.path), request, profile, build=installed_build(m))


def _costs_of(plan: Plan) -> str:
    return CostModel(**plan.cost_model).describe() if plan.cost_model else CostModel().describe()


def contenders(m: InstalledModel, progress: ProgressFn = silent) -> list[Contender]:
    """What the check runs for an installed model: its plan, the plan made with the fitted figures where
    that differs in its server's flags or environment (not where the plan was made with them already),
    and stock's placement."""
    build = installed_build(m)
    binary = str(build.binary("llama-server"))

    def side(args: list[str], env: dict[str, str]) -> Side:
        return Side(list(args), dict(env), binary=binary, build_id=build.build_id)

    mine = m.plan
    weight = mine.prefill_weight
    out = [Contender("plan", mine, _costs_of(mine), side(mine.server_args, m.server_env()), weight)]
    if mine.cost_model is not None:
        fitted = fitted_plan(m)
        env = m.server_env() | fitted.server_env()
        if fitted.server_args != mine.server_args or env != m.server_env():
            out.append(Contender("fitted", fitted, GPU_MACHINE, side(fitted.server_args, env), weight))
        else:
            progress(Note(f"{m.name}: the fitted figures plan the same server flags as this machine's: one plan "
                          f"to check"))
    out.append(Contender("stock", None, "", side(stock_args(mine), dict(mine.device_env)), weight))  # the same GPU
    return out


def _ratios(mine: dict[int, list[float]], theirs: dict[int, list[float]]) -> list[float]:
    """Per prompt both sides ran: the ratio of the medians over rounds."""
    return [statistics.median(mine[i]) / statistics.median(theirs[i]) for i in sorted(mine)
            if i in theirs and statistics.median(theirs[i]) > 0]


def _median_tps(samples: dict[int, list[float]]) -> float | None:
    return statistics.median(statistics.median(v) for v in samples.values()) if samples else None


def _pairs(mine: dict[int, list[float]], theirs: dict[int, list[float]]) -> list[tuple[list[float], list[float]]]:
    return [(mine[i], theirs[i]) for i in sorted(mine) if i in theirs]


def _median_ratio(a: Contender, b: Contender) -> float | None:
    r = _ratios(a.mixed(), b.mixed())
    return statistics.median(r) if r else None


def close_pair(ranked: list[Contender]) -> bool:
    """Whether the two fastest (ranked, fastest first) are within CLOSE of each other with their order not
    resolved by the rounds so far (the 95% interval of their ratio reaches 1.0)."""
    if len(ranked) < 2:
        return False
    a, b = ranked[0], ranked[1]
    ratio = _median_ratio(a, b)
    if ratio is None or ratio >= 1.0 + CLOSE:
        return False
    interval = median_ratio_interval(_pairs(a.mixed(), b.mixed()))
    return interval is None or interval[0] <= 1.0


def ranked(cands: list[Contender]) -> list[Contender]:
    """The candidates fastest first, by their speed over stock's placement (Contender.mixed; stock's own: 1.0)."""
    stock = cands[-1]

    def key(c: Contender) -> float:
        r = _median_ratio(c, stock)
        return -1.0 if r is None else r

    return sorted(cands, key=key, reverse=True)


def candidate_record(c: Contender, stock: Contender) -> Candidate:
    """What a candidate measured, against stock's placement."""
    decode = _ratios(c.decode(), stock.decode())
    prefill = _ratios(c.side.samples("text", "prefill"), stock.side.samples("text", "prefill"))
    speed = _ratios(c.mixed(), stock.mixed())
    rounds = max((len(v) for v in c.decode().values()), default=0)
    return Candidate(c.name, c.costs, list(c.side.args), rounds, _median_tps(c.decode()),
                     _median_tps(c.side.samples("text", "prefill")),
                     statistics.median(decode) if decode else None, min(decode) if decode else None,
                     median_ratio_interval(_pairs(c.decode(), stock.decode())),
                     statistics.median(prefill) if prefill else None,
                     plan_summary(c.plan) if c.plan else "stock --fit",
                     statistics.median(speed) if speed else None, c.prefill_weight)


def choose(records: list[Candidate], bar: float) -> tuple[str, Candidate]:
    """The candidate to serve and the best plan: the plan of the highest speed over stock's placement
    (Candidate.speed), unless that is below `bar` (1.0: stock's placement is faster), then stock's."""
    plans = [r for r in records if r.name != "stock"]
    best = max(plans, key=lambda r: -1.0 if r.speed is None else r.speed)
    return ("stock" if best.speed is None or best.speed < bar else best.name), best


def check_plan(m: InstalledModel, bar: float = CHECK_BAR, progress: ProgressFn = silent) -> tuple[Verdict, Plan]:
    """Run the installed model's candidates (contenders) side by side and choose (choose). Returns the
    verdict and the plan to keep with the model: the best plan (the fitted figures' where it won)."""
    t0 = time.monotonic()
    cands = contenders(m, progress)
    texts = bench_prompts([], CHECK_PROMPTS)
    options = BenchOptions(rounds=1, n_predict=CHECK_PREDICT, prefill_reps=1)
    launcher = Launcher(m.name, m, {c.name: c.side for c in cands}, "stock", texts[0], progress)
    first = CHECK_ROUNDS * len(cands)
    progress(Note(f"{m.name}: checking {len(cands)} placements on this machine ({', '.join(c.name for c in cands)}): "
                  f"{CHECK_ROUNDS} rounds of {len(texts)} held-out prompts answering {CHECK_PREDICT} tokens, "
                  f"{first} server launches, more rounds for the two fastest where they are close (up to "
                  f"{CHECK_MAX_ROUNDS}); a few minutes ('--no-check' skips it)"))
    launches = 0

    def run(c: Contender, total: int) -> None:
        nonlocal launches
        progress(Step(TASK, launches, total, "launch", every=0))
        try:
            run_side(launcher, c.name, {"text": texts}, None, options, first=False)
        except MoeplugError as exc:
            raise MoeplugError(f"the check, {c.name}: {exc}") from None
        launches += 1
        if launches == 1:
            each = time.monotonic() - t0
            progress(Note(f"  one launch took {each:.0f} s: about {each * total / 60:.1f} min for the check"))
        progress(Step(TASK, launches, total, "launch", every=0))

    for r in range(CHECK_ROUNDS):
        k = r % len(cands)
        for c in cands[k:] + cands[:k]:
            run(c, first)
    rounds = CHECK_ROUNDS
    order = ranked(cands)
    while rounds < CHECK_MAX_ROUNDS and close_pair(order):
        pair = order[:2] if rounds % 2 == 0 else order[1::-1]
        progress(Note(f"  {pair[0].name} and {pair[1].name} within {CLOSE:.0%} of each other: another round of both"))
        for c in pair:
            run(c, launches + 2)
        rounds += 1
        order = ranked(cands)
    stock = cands[-1]
    records = [candidate_record(c, stock) for c in cands]
    chosen, best = choose(records, bar)
    progress(Note("  " + "; ".join(f"{r.name} decode {_tps(r.decode_tps)}" + (f" ({r.speed:.2f}x)" if r.name != "stock"
                                                                            and r.speed is not None else "")
                                   for r in records)))
    verdict = Verdict(chosen if chosen == "stock" else "moeplug", best.decode, best.prefill, best.decode_lowest,
                      len(texts), m.plan.vram_budget_bytes, time.time(), bar, chosen, records, CHECK_ROUNDS,
                      round(time.monotonic() - t0, 1), best.speed)
    kept = next(c.plan for c in cands if c.name == best.name)
    return verdict, kept if kept is not None else m.plan


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} t/s"


def costs_kept(verdict: Verdict) -> str:
    """The figures the model's later re-plans use (PlanRequest.costs): the fitted ones where the check
    found the plan made with them the faster."""
    best = max((c for c in verdict.candidates if c.name != "stock"),
               key=lambda c: -1.0 if c.speed is None else c.speed, default=None)
    return COSTS_FITTED if best is not None and best.name == "fitted" else COSTS_MACHINE
