"""The check at the end of `moeplug install`: the plan against stock `--fit` on this machine, and the
placement served where moeplug's is slower here.

The planner's costs may be fitted elsewhere or measured crudely (operations.calibrate); what settles
whether the slots pay on this machine is running both. The check is `moeplug bench` made short (one
round, a few bundled held-out prompts, short answers; the stock side on the same build with stock's
flags, so nothing more is built) and judged on decode, the rate a user waits on after the prompt:
where moeplug's median over the prompts is below a bar of stock's (CHECK_SLOWER unless the user
sets `--check-min`), beyond what so short a check resolves, the model is served with stock's placement through the same binary, and the record
says so (serving.installed.Verdict). `moeplug bench NAME` looks closer; `moeplug install MODEL
--no-check` serves the slots anyway.
"""

from __future__ import annotations

import time
from typing import Any

from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.operations.bench import BenchOptions, compare
from moeplug.serving.installed import Verdict

# a plan that decodes below this share of stock's in the check is served with stock's placement: one
# round of three prompts moves by a few percent run to run, so a smaller loss is not taken as one
CHECK_SLOWER = 0.95
CHECK_OPTIONS = BenchOptions(rounds=1, n_predict=24, prefill_reps=1, max_prompts=3, stock_binary="patched")


def judged(doc: dict[str, Any], budget: int | list[int] | None, bar: float = CHECK_SLOWER) -> Verdict:
    """The verdict on a comparison's JSON (operations.bench.Comparison.to_json): stock's placement
    where moeplug's median decode is below `bar` of stock's."""
    text = doc["workloads"]["text"]
    decode, prefill = text["decode"]["ratio_median"], text["prefill"]["ratio_median"]
    slower = decode is not None and decode < bar
    return Verdict("stock" if slower else "moeplug", decode, prefill, text["decode"]["ratio_lowest"],
                   text["prompts"], budget, time.time(), bar)


def check_plan(name: str, bar: float = CHECK_SLOWER, progress: ProgressFn = silent) -> Verdict:
    """The installed model's plan against stock --fit at its budget (CHECK_OPTIONS), judged against
    `bar` (judged)."""
    progress(Note(f"{name}: checking the plan against stock --fit on this machine (one short round; "
                  f"--no-check skips it)"))
    done = compare(name, CHECK_OPTIONS, progress)
    return judged(done.to_json(), done.budget_bytes, bar)
