"""`moeplug bench NAME`: the installed plan against stock --fit at the same budget (moeplug.operations.bench)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from moeplug.planner.estimates import DEFAULT_UBATCH
from moeplug.commands.install import PROMPT_TOKENS, UBATCH
from moeplug.serving.measure import SHORT_STEPS
from moeplug.commands.options import (CONCURRENT, GENERATE, PROMPT_CAP, REPEATS, ROUNDS, SERVER_THREADS, SHORT_PROMPT,
                                     add_json)
from moeplug.operations.bench import STOCK_VRAM
from moeplug.core.output import Output, human_bytes, table

WHAT = {"text": "prompts", "chat": "chat turns (each prompt a conversation on the prompt cache)",
        "long": "long prompts (the prompts' text one after another, cut to the length)",
        "short": "short prompts (each prompt's first tokens: a chat's opening line, a short request)",
        "concurrent": "prompts sent together (a row is a group: prefill its prompts' tokens over the longest prompt's "
                      "time, decode its generated tokens over the wall time the group waited, prompts included)"}
NOUN = {"text": "prompts", "chat": "chat turns", "long": "long prompts", "short": "short prompts",
        "concurrent": "groups"}
HEAD = ["#", "tokens", "prefill t/s moeplug / stock", "prefill", "decode t/s moeplug / stock", "decode"]


def _ratio(d: dict[str, Any]) -> str:
    if d["ratio_median"] is None:
        return "-"
    iv = d.get("ratio_interval")
    within = f"; 95% interval over rounds {iv[0]:.2f}x-{iv[1]:.2f}x" if iv else ""
    return f"{d['ratio_median']:.2f}x (lowest {d['ratio_lowest']:.2f}x{within})"


def _threads(args: list[str]) -> str:
    """A side's -t, or llama.cpp's default."""
    return _flag(args, "-t", "llama.cpp's default")


def _flag(args: list[str], flag: str, default: str) -> str:
    """The value of a side's flag, or what llama.cpp takes without it."""
    return args[args.index(flag) + 1] if flag in args else default


BELOW_PAR = 0.97  # a prompt this much slower than stock is named under its table


def _below_par(rows: list[dict[str, Any]], noun: str, versus: str = "stock") -> str | None:
    """One line naming the rows whose prefill, decode or short answer's decode ran below BELOW_PAR of stock
    (or of `versus`, the other side's name), or None."""
    said = []
    for what, label in (("prefill", "prefill"), ("decode", "decode"), ("decode_short", "short answers' decode")):
        slow = [(r["prompt"], r[what]["ratio"]) for r in rows if what in r and r[what]["ratio"] is not None
                and r[what]["ratio"] < BELOW_PAR]
        if slow:
            said.append(f"{label} {', '.join(f'#{i} {x:.2f}x' for i, x in slow)}")
    return f"below {BELOW_PAR:.2f}x of {versus} here, of the {len(rows)} {noun}: {'; '.join(said)}" if said else None


def _stock_over(budget: int | list[int] | None, stock: int, mine: int, stock_vram: str) -> str | None:
    """A line where stock, given the budget as users run it, held more than the budget: the ratios then
    compare unequal VRAM, and --stock-vram budget compares at the same (one GPU's budget only)."""
    if stock_vram != "fit" or not isinstance(budget, int) or stock <= budget:
        return None
    return (f"stock held {human_bytes(stock - budget)} more than the budget and {human_bytes(stock - mine)} more "
            f"than moeplug ('--stock-vram budget' holds stock to the budget, to compare at the same VRAM)")


def _other_over(budget: int | list[int] | None, other: int, mine: int, label: str) -> str | None:
    """A line where a llama-server of the user's (--against) held more than the plan's budget: the
    ratios then compare unequal VRAM."""
    if not isinstance(budget, int) or other <= budget:
        return None
    return (f"{label} held {human_bytes(other - budget)} more than the plan's budget and {human_bytes(other - mine)} "
            f"more than moeplug (its flags in --against-args decide what it holds)")


def _stock_side(doc: dict[str, Any]) -> str:
    """One line: the build each side ran, and whether stock's was unpatched or the patched one with stock's
    flags (--stock-binary patched); for --against, the user's binary and its flags."""
    mine = doc["sides"]["moeplug"]["build_id"]
    if doc.get("other") == "against":
        theirs = doc["against"]
        return (f"builds: moeplug {mine}; against {theirs['binary']} (yours) with "
                f"{' '.join(theirs['args']) or 'no flags'}")
    stock = doc["stock_build"]
    if stock["patched"]:
        return (f"builds: moeplug {mine}; stock ran the same patched build {stock['build_id']} with stock's flags "
                f"(--stock-binary patched), not an unpatched llama.cpp")
    return f"builds: moeplug {mine}; stock {stock['build_id']} (unpatched llama.cpp of the same pin)"


def comparison_text(c: Any) -> str:
    doc = c.to_json()
    budget = c.budget_bytes
    other = getattr(c, "other", "stock")
    versus = "stock" if other == "stock" else Path(c.other_label).name  # the other side in the tables' cells
    said = ("no budget (no GPU)" if budget is None else
            ", ".join(human_bytes(b) for b in budget) if isinstance(budget, list) else human_bytes(budget))
    held = " (stock held to it)" if c.stock_vram == "budget" and c.fit_tries else ""
    rounds = (f"{c.rounds} round{'s' if c.rounds > 1 else ''}, {c.n_predict} tokens generated per prompt, prefill the "
              f"median of {c.prefill_reps} request{'s' if c.prefill_reps > 1 else ''}")
    if other == "stock":
        lines = [f"{c.name}: moeplug's plan against stock llama-server --fit at the same budget ({said}{held}); {rounds}"]
    else:
        lines = [f"{c.name}: moeplug's plan ({said}) against {c.other_label}, the same prompts; {rounds}"]
    head = [h.replace("moeplug / stock", f"moeplug / {versus}") for h in HEAD]
    for w, d in doc["workloads"].items():
        rows = [[r["prompt"], r["prompt_tokens"],
                 f"{r['prefill']['moeplug_tps']:.1f} / {r['prefill'][f'{other}_tps']:.1f}",
                 f"{r['prefill']['ratio']:.2f}x", f"{r['decode']['moeplug_tps']:.1f} / {r['decode'][f'{other}_tps']:.1f}",
                 f"{r['decode']['ratio']:.2f}x"] for r in d["rows"]]
        lines += ["", f"{WHAT[w]}:", table(head, rows, "rrrrrr")]
        lines.append(f"prefill {_ratio(d['prefill'])}, decode {_ratio(d['decode'])} of {versus} (median over "
                     f"{d['prompts']} {NOUN[w]})")
        rounds = d["per_round"]
        if c.rounds > 1 and all(rounds[side]["decode"] for side in rounds):
            lines.append(f"decode t/s round by round (median over the {NOUN[w]}; a round off on one side is a server "
                         f"process that ran slow): " + "; ".join(
                             f"{side} {', '.join(f'{x:.1f}' for x in r['decode'])}" for side, r in rounds.items()))
        if "decode_short" in d:
            lines.append(f"short answers alone ({SHORT_STEPS} tokens, a new prompt on the slots another prompt left): "
                         f"decode {_ratio(d['decode_short'])}")
        below = _below_par(d["rows"], NOUN[w], versus)
        if below:
            lines.append(below)
        if w == "chat" and d["opening"]["prefill"]["ratio_median"] is not None:
            o, later = d["opening"], d["later"]
            lines.append(f"opening turns alone (a new conversation, on the slots another one left): prefill "
                         f"{_ratio(o['prefill'])}, decode {_ratio(o['decode'])}; later turns: prefill "
                         f"{_ratio(later['prefill'])}, decode {_ratio(later['decode'])}")
        if c.prefill_reps > 1 and w in ("text", "long", "short"):
            lines.append(f"each prompt's first request alone (the slots another prompt left): prefill "
                         f"{_ratio(d['first'])}")
    named = {side: versus if side == other else side for side in doc["sides"]}  # the user's server by its binary
    lines.append("CPU threads: " + ", ".join(f"{named[side]} {_threads(s['args'])}" for side, s in doc["sides"].items()))
    lines.append("prompt batch: " + ", ".join(f"{named[side]} {_flag(s['args'], '-ub', str(DEFAULT_UBATCH))}"
                                               for side, s in doc["sides"].items()))
    vram = {side: [v for v in s["vram_bytes"] if v is not None] for side, s in doc["sides"].items()}
    if all(vram.values()):
        lines.append("VRAM held: " + ", ".join(f"{named[side]} {human_bytes(max(v))}" for side, v in vram.items()))
        over = (_stock_over(budget, max(vram["stock"]), max(vram["moeplug"]), c.stock_vram) if other == "stock" else
                _other_over(budget, max(vram[other]), max(vram["moeplug"]), versus))
        if over:
            lines.append(over)
    if c.fit_tries:
        lines.append("stock held to the budget: " + ", then ".join(
            f"-fitt {t['fitt']} held {'?' if t['held_bytes'] is None else human_bytes(t['held_bytes'])}"
            for t in c.fit_tries))
    lines.append(_stock_side(doc))
    lines += [f"note: {n}" for n in c.notes]
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from moeplug.operations.bench import BenchOptions, compare

    out = Output.for_args(args)
    options = BenchOptions(rounds=args.rounds, n_predict=args.n_predict, prefill_reps=args.prefill_reps,
                           prompt_files=tuple(Path(p) for p in args.prompt_file), max_prompts=args.max_prompts,
                           chat=args.chat, stock_vram=args.stock_vram, threads=args.threads,
                           stock_threads=args.stock_threads, stock_ubatch=args.stock_ubatch,
                           prompt_tokens=args.prompt_tokens, concurrent=args.concurrent or 0, short=args.short or 0,
                           stock_binary=args.stock_binary, against=args.against, against_args=args.against_args)
    done = compare(args.model, options, progress=out.progress)
    return out.result(done, comparison_text)


def register(sub: Any) -> None:
    from moeplug.operations.bench import LONG_PROMPTS, STOCK_BINARIES

    p = sub.add_parser("bench", help="the installed plan against stock llama.cpp --fit at the same budget, here",
                       description="Serve an installed model with its plan and with stock llama-server --fit at the "
                       "same VRAM budget, in turns, on the same prompts; print each prompt's prefill and decode "
                       "speed on both sides and the ratios. Stop the model first if it is served.")
    p.add_argument("model", help="an installed name (see 'moeplug list')")
    p.add_argument("--rounds", type=ROUNDS, default=3,
                   help="launches of each side, alternating (default 3: a prompt's median over three rounds "
                        "leaves out one delayed request, where over two it is their mean)")
    p.add_argument("-n", "--n-predict", type=GENERATE, default=64,
                   help=f"tokens generated per prompt (default 64); above {SHORT_STEPS + 1}, each prompt is also "
                        f"answered in {SHORT_STEPS} tokens, the first tokens after a new prompt timed alone")
    p.add_argument("--prefill-reps", type=REPEATS, default=3,
                   help="requests per prompt and launch whose prefill is timed, the median kept (default 3)")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help="your own prompts (.txt, separated by lines of '---'), or a bundled set's name (codeish, "
                        "chatty: the ones profiles are made from); repeatable; default: the bundled held-out set, "
                        "which profiling never runs")
    p.add_argument("--max-prompts", type=PROMPT_CAP, default=8, help="at most this many prompts (0: all; default 8)")
    p.add_argument("--chat", action="store_true",
                   help="also each prompt as a conversation of three turns on the server's prompt cache")
    p.add_argument("--stock-vram", choices=STOCK_VRAM, default="fit",
                   help="fit: stock --fit given the budget as users run it (llama.cpp's estimate leaves out some of "
                        "what its server holds, so it may hold more); budget: first raise stock's -fitt, a launch "
                        "at a time, until it holds no more than the budget, as the plan does (one GPU)")
    p.add_argument("--threads", "-t", type=SERVER_THREADS, metavar="N",
                   help="moeplug's CPU threads for this comparison, in place of the plan's (0: llama.cpp's default; "
                        "the installed plan is not changed: 'moeplug serve NAME --threads N' keeps a count)")
    p.add_argument("--stock-threads", type=SERVER_THREADS, metavar="N",
                   help="stock's CPU threads, 0-1024 (0, the default: llama.cpp's, as users run it): with the same count "
                        "on both sides the ratio is the cache's alone")
    p.add_argument("--stock-ubatch", type=UBATCH, metavar="N",
                   help="stock's prompt batch (llama-server -ub), 32-65536 (default: llama.cpp's 512, as users run "
                        "it): the plan's own on both sides leaves the cache's part of the prefill ratio alone")
    p.add_argument("--prompt-tokens", type=PROMPT_TOKENS, metavar="N",
                   help=f"also time {LONG_PROMPTS} long prompts of N tokens, the prompts' text one after another "
                        f"(default: the prompt length the plan was made for, set or learned by 'moeplug reprofile', "
                        f"where it has one; 0: none)")
    p.add_argument("--short", type=SHORT_PROMPT, metavar="N",
                   help="also time each prompt cut to its first N tokens, 1-4096, as a chat's opening line or a "
                        "short request (llama.cpp computes a prompt below 32 tokens on the CPU; moeplug's plans send "
                        "one of 8 or more to the GPU)")
    p.add_argument("--concurrent", type=CONCURRENT, metavar="N",
                   help="also send the prompts N at a time, 2-64, as users or agents sharing the server do, and compare "
                        "what both sides deliver to all of them together (beyond llama-server's 4 parallel slots, "
                        "both get N)")
    p.add_argument("--stock-binary", choices=STOCK_BINARIES,
                   help="the build stock's side runs: stock (the default), an unpatched llama.cpp of the same pin, "
                        "built once where it is not there yet; patched, the model's own build with stock's flags "
                        "(the patches unused without the cache's flags), said in the output")
    p.add_argument("--against", metavar="BIN",
                   help="run the plan against a llama-server of yours in stock's place (a newer llama.cpp with its "
                        "own expert cache, ik_llama.cpp, Ollama's bundled one): the same prompts and rounds, the "
                        "plan's context, your flags from --against-args; the VRAM each process holds counted alike")
    p.add_argument("--against-args", metavar='"FLAGS"',
                   help="the flags of --against's server, quoted as a shell quotes them, e.g. \"--fit on "
                        "--moe-cache-mib 2048\" (default: none but the plan's -c)")
    add_json(p)
    p.set_defaults(func=cmd_bench)
