"""`moeplug install | plan | serve | stop | status | list`: the commands around a served model.

Each command parses, calls one library action (moeplug.operations.install, moeplug.operations.actions) and hands the
result to the output sink with its text renderer below.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeplug.commands.options import (JOBS, TOKENS, Number, add_backend, add_json, add_plan_options, add_prefill_weight, add_serve_options,
                             add_spec_options, add_threads)
from moeplug.planner.estimates import DEFAULT_UBATCH, MIN_UBATCH
from moeplug.core.output import Output, fitted_table, human_bytes, shell_lines, table, terminal_width, wrap_lines
from moeplug.planner.record import Plan, describe_blocks, describe_slots
from moeplug.planner.request import UBATCH_AUTO
from moeplug.serving.server import HOST
from moeplug.serving.launch import cache_summary, slot_range, streamed_text
from moeplug.core.sizes import MIB


def _costs(p: Plan) -> str:
    """Where the plan's costs come from, and the figures a machine changes most."""
    from moeplug.planner.costs import DEFAULT_COSTS, CostModel

    return CostModel.from_json(p.cost_model).describe() if p.cost_model else DEFAULT_COSTS.describe() + \
        " ('moeplug calibrate' measures this machine's)"


def _hop(p: Plan) -> str:
    """A plan's hop to a remote device, and where it comes from."""
    from moeplug.planner.costs import DEFAULT_COSTS, CostModel

    costs = CostModel.from_json(p.cost_model) if p.cost_model else DEFAULT_COSTS
    measured = costs.rpc_hop_s != DEFAULT_COSTS.rpc_hop_s
    return (f"{costs.rpc_hop_s * 1e3:.2f} ms there and back a step" +
            (f" ({costs.source})" if measured else " (a LAN's, not measured: 'moeplug calibrate --rpc HOST:PORT')"))


def plan_text(p: Plan, width: int | None = None) -> str:
    """The plan for people; width: fit that many columns (the terminal's: output.terminal_width), the
    long values, server args and notes broken over lines; None: one line each."""
    remote = any(d.endpoint for d in p.devices or [])
    rows = [
        ["budget, every device" if remote else "VRAM budget",
         human_bytes(p.vram_budget_bytes) if p.vram_budget_bytes else "no GPU"],
        ["non-expert weights", human_bytes(p.non_expert_vram_bytes)],
        [f"KV cache ({p.ctx} tokens)", human_bytes(p.kv_cache_bytes)],
        ["compute buffer + CUDA pool", human_bytes(p.compute_bytes)],
        ["safety margin", human_bytes(p.margin_bytes)],
        *_draft_rows(p),
        ["one slot (all MoE layers)", human_bytes(p.bytes_per_slot)],
        ["slots", f"{describe_slots(p.slots_per_layer, p.n_expert)}, {p.fit_fraction:.0%} of experts"],
        ["experts in VRAM", human_bytes(p.expert_vram_bytes)],
        ["predicted hit rate", f"{p.predicted_hit_rate:.1%}" if p.predicted_hit_rate is not None else "no profile"],
        ["stock -ncmoe for this budget", str(p.stock_ncmoe) if p.stock_ncmoe is not None else "-"],
        ["modelled host time per token" if p.tokens_per_step == 1 else
         f"modelled host time per batch of {p.tokens_per_step}", _host_ms(p)],
        ["prompt tokens per generated token", f"{p.prefill_weight:g} ({_workload_source(p)})"],
        ["modelled prompt uploads per prompt token", _prompt_us(p)],
        ["misses the GPU computes beside the CPU", _stream(p)],
        *([["prompt batches' expert weights", "copied ahead, beside the split before" if p.copy_ahead else
            "copied one at a time, as stock's (the second copy's bytes hold slots)"]] if p.vram_budget_bytes else []),
        ["load mode", p.load_mode],
        ["CPU threads", f"{p.threads} (-t)" if p.threads else "llama.cpp's default"],
        ["prompt length planned for", (f"{p.prompt_tokens} tokens (" + ("learned" if p.workload else "--prompt-tokens")
                                       + ")") if p.prompt_tokens else "the profile's prompts"],
        ["prompt batch", f"{p.ubatch} tokens (-ub), " + _ubatch_source(p)],
        *([["costs (CPU, bus)", _costs(p)]] if p.backend.gpu else []),
        *([["hop to a remote device", _hop(p)]] if remote else []),
    ]
    lines = [fitted_table(["plan", ""], rows, width)] + ([devices_text(p)] if p.devices else [])
    lines += [shell_lines("server args: ", p.server_args, width)]  # quoted: -ot has | ( )
    lines += [wrap_lines("server environment: " + " ".join(f"{k}={v}" for k, v in sorted(p.server_env().items())),
                         width)] if p.server_env() else []
    lines += [wrap_lines(f"note: {n}", width) for n in p.notes] + [wrap_lines(f"WARNING: {w}", width)
                                                                   for w in p.warnings]
    return "\n".join(lines)


def _workload_source(p: Plan) -> str:
    """Where a plan's prefill weight came from."""
    if not p.workload:
        return "planned for"
    return f"learned from {p.workload.get('requests', 0)} requests served ('moeplug reprofile')"


def _ubatch_source(p: Plan) -> str:
    """Who chose a plan's prompt batch."""
    if p.ubatch_asked != UBATCH_AUTO:
        return "as asked (--ubatch)"
    if p.prompt_tokens and p.prompt_tokens > DEFAULT_UBATCH:
        return f"the planner's choice for prompts of {p.prompt_tokens} tokens"
    return "llama.cpp's default (--prompt-tokens N: the planner weighs larger ones for prompts of N tokens)"


def devices_text(p: Plan) -> str:
    """Per device of a split plan (two GPUs, or remote devices before this machine's GPUs): where it is,
    its layers, whole layers and slots, and its bytes against its budget (with speculation, its share
    of the draft too)."""
    rows, remote = [], any(d.endpoint for d in p.devices or [])
    for d in p.devices or []:
        blocks = d.blocks
        held = f"{blocks[0]}-{blocks[-1]}" if blocks else "none"
        draft = [human_bytes(d.draft_weights_bytes + d.draft_kv_cache_bytes + d.draft_compute_bytes)]
        where = [d.endpoint or "this machine"] if remote else []
        rows.append([d.device, *where, held + (" + output" if d.output else ""), d.moe_layers, d.whole_layers,
                     d.slots, human_bytes(d.non_expert_bytes + d.kv_cache_bytes + d.compute_bytes
                                             + d.margin_bytes),
                     human_bytes(d.expert_vram_bytes), *(draft if p.speculation else []),
                     human_bytes(d.budget_bytes), human_bytes(d.headroom_bytes)])
    split = ",".join(map(str, p.tensor_split or []))
    draft_head = ["draft"] if p.speculation else []
    where_head = ["host"] if remote else []
    head = ["device" if remote else "GPU", *where_head, "blocks", "MoE layers", "whole", "slots", "other VRAM",
            "experts", *draft_head, "budget", "headroom"]
    return (table(head, rows, "ll" + "l" * len(where_head) + "r" * (len(head) - 2 - len(where_head)))
            + f"\nlayer split: -sm layer --tensor-split {split} (as llama.cpp places layers)")


def _draft_rows(p: Plan) -> list[list[str]]:
    if not p.speculation:
        return []
    return [["speculation", f"{p.speculation['spec_type']}, up to {p.speculation['n_draft']} draft tokens per step"],
            ["draft weights", human_bytes(p.draft_weights_bytes)],
            [f"draft KV cache ({p.ctx} tokens)", human_bytes(p.draft_kv_cache_bytes)],
            ["draft compute buffer", human_bytes(p.draft_compute_bytes)]]


def _host_ms(p: Plan) -> str:
    if p.modelled_host_ms is None:
        return "-"
    return f"{p.modelled_host_ms:.2f} ms (stock --fit's placement: {p.stock_modelled_host_ms:.2f} ms)"


def _stream(p: Plan) -> str:
    if not p.stream_share:
        return "none"
    return (f"the hottest, {p.stream_share:.0%} of the selections (modelled {p.modelled_stream_saving_ms:.2f} ms less "
            f"host time per {'token' if p.tokens_per_step == 1 else 'batch'})")


def _prompt_us(p: Plan) -> str:
    if p.modelled_prompt_us is None or p.stock_modelled_prompt_us is None:
        return "-"
    guard = f"; prompts weighed {p.prefill_guard:g}x to keep stock's" if p.prefill_guard > 1 else ""
    return f"{p.modelled_prompt_us:.1f} us (stock --fit's placement: {p.stock_modelled_prompt_us:.1f} us{guard})"


def served_text(name: str, srv: Any) -> str:
    """How a served model is doing and how to use it (srv: a serving.ServerRecord)."""
    cache = srv.cache or {}
    lines = []
    if cache.get("engaged"):
        whole = f" ({cache['whole_layers']} whole)" if cache.get("whole_layers") else ""
        lines.append(f"expert cache: {cache['layers']} layers x {slot_range(cache)} slots{whole}, {cache['mib_uploaded']:.2f} MiB "
                     f"on {cache['device']} in {cache['seconds']:.2f} s{streamed_text(cache)}")
    elif cache:
        lines.append(f"expert cache: not engaged ({cache['reason']})")
    lines.append(f"serving {name} at {srv.url} (pid {srv.pid}, log {srv.log})")
    lines.append(f"query:  curl {srv.url}/v1/chat/completions -H 'Content-Type: application/json' "
                 "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")
    lines.append(f"stop:   moeplug stop {name}")
    return "\n".join(lines)


def install_text(done: Any, width: int | None = None) -> str:
    lines = [f"installed {done.name}: {done.model}", f"profile  {done.profile}", plan_text(done.plan, width)]
    lines += check_lines(done.verdict, width) if done.verdict else []
    return "\n".join(lines + ([served_text(done.name, done.server)] if done.server else []))


def check_lines(verdict: Any, width: int | None = None) -> list[str]:
    """The install's check: a row per candidate (its decode and prefill t/s, its ratios to stock's
    placement, its rounds; the one served starred), each plan in a few words, then the verdict's line."""
    rows = [[("* " if c.name == verdict.chosen else "  ") + c.name, _tps(c.decode_tps), _x(c.decode),
             _x(c.decode_lowest), _tps(c.prefill_tps), _x(c.prefill), str(c.rounds)] for c in verdict.candidates]
    if not rows:
        return [f"check    {verdict.line()}", f"         {verdict.why()}"]
    plans = [wrap_lines(f"  {c.name}: {c.summary}; {c.costs}", width) for c in verdict.candidates if c.name != "stock"]
    return [table(["check", "decode", "vs stock", "lowest", "prefill", "vs stock", "rounds"], rows, "lrrrrrr"),
            *plans, f"check    {verdict.line()}", f"         {verdict.why()}"]


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} t/s"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


# the server's prompt batch (-ub): an option of install, plan and serve, and bench's --stock-ubatch
UBATCH = Number(int, MIN_UBATCH, 65536, "a number of prompt tokens per batch")
PROMPT_TOKENS = Number(int, 0, 1 << 20, "a prompt length in tokens")
CHECK_MIN = Number(float, 0.01, 100.0, "a share of stock's decode speed")


def ubatch_or_auto(text: str) -> int:
    """--ubatch: a number of tokens (UBATCH), or 'auto' for the planner's choice (UBATCH_AUTO)."""
    if text == "auto":
        return UBATCH_AUTO
    try:
        return UBATCH(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}, or auto") from None


def add_ubatch(p: argparse.ArgumentParser, keep: bool = False) -> None:
    """--ubatch N|auto and --prompt-tokens N: the server's physical batch and the prompt length the plan's
    prompt batches are priced for (plan.make_plan)."""
    default = "the installed plan's" if keep else "auto"
    p.add_argument("--ubatch", "-ub", type=ubatch_or_auto, default=None, metavar="N|auto",
                   help=f"prompt tokens per batch on the GPU (llama-server -ub), {MIN_UBATCH}-65536, or auto: prompt "
                        f"batches upload the experts of every layer that is not whole once per batch, so 2048 "
                        f"prefills long prompts faster, and holds slightly more VRAM, which the slots give up; auto "
                        f"weighs {DEFAULT_UBATCH} (llama.cpp's), 1024 and 2048 for prompts of --prompt-tokens "
                        f"(default: {default})")
    default = "the installed plan's" if keep else "the profile's prompts"
    p.add_argument("--prompt-tokens", type=PROMPT_TOKENS, default=None, metavar="N",
                   help=f"the length of the prompts to plan prompt batches for, e.g. 8000 for an agent that sends "
                        f"whole files; with --prefill-weight, how many prompt tokens come per generated token "
                        f"(default: {default}; 0: the profile's prompts)")


def plan_choices(args: argparse.Namespace, spec: Any) -> Any:
    """The plan choices a command line gave (PlanChoices: None where not given)."""
    from moeplug.planner.request import PlanChoices

    return PlanChoices(vram_budget=args.vram_budget, ctx=args.ctx, ctx_override=args.ctx_override, spec=spec,
                       prefill_weight=args.prefill_weight, threads=args.threads, ubatch=args.ubatch,
                       prompt_tokens=args.prompt_tokens,
                       calibration=str(Path(args.calibration).resolve()) if args.calibration else None,
                       rpc=args.rpc, rpc_budget=args.rpc_budget)


def serve_options(args: argparse.Namespace) -> Any:
    from moeplug.serving.launch import ServeOptions

    return ServeOptions(port=args.port, host=args.host or HOST, allow_fallback=args.allow_fallback,
                        metrics=args.metrics, record=args.record)


def cmd_install(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import install
    from moeplug.planner.speculation import parse_spec

    out = Output.for_args(args)
    done = install(args.model, plan_choices(args, parse_spec(args.spec, args.spec_draft_max)),
                   None if args.no_serve else serve_options(args), backend=args.backend, jobs=args.jobs,
                   profile_tokens=args.profile_tokens, prompt_sets=[s for s in args.prompts.split(",") if s],
                   check=args.check, check_min=args.check_min, progress=out.progress)
    return out.result(done, lambda d: install_text(d, terminal_width()))


def cmd_plan(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import plan_model
    from moeplug.planner.speculation import parse_spec

    text = f"draft:{args.draft}" if args.draft is not None else "mtp" if args.mtp else args.spec
    out = Output.for_args(args)
    plan = plan_model(args.model, plan_choices(args, parse_spec(text, args.spec_draft_max, keep=True)),
                      profile=Path(args.profile) if args.profile else None, progress=out.progress)
    return out.result(plan, lambda p: plan_text(p, terminal_width()))


def cmd_serve(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import serve
    from moeplug.planner.speculation import parse_spec

    out = Output.for_args(args)
    served = serve(args.model, plan_choices(args, parse_spec(args.spec, args.spec_draft_max, keep=True)),
                   serve_options(args), check=args.check, progress=out.progress)
    return out.result(served, lambda s: served_text(s.name, s.server))


def cmd_stop(args: argparse.Namespace) -> int:
    from moeplug.operations.actions import stop

    out = Output.for_args(args)
    stopped = stop(args.model, all_served=args.all, progress=out.progress)
    return out.result(stopped, lambda r: "\n".join(
        f"{n}: {'stopped' if n in r.stopped else 'was not running'}" for n in r.names))


def _hit_rate_text(counters: dict[str, Any] | None, counted: bool = True) -> str:
    """counted: served with the counters (--metrics, the default)."""
    if counters is None:
        return "-" if counted else "- (served --no-metrics)"
    if counters["hit_rate"] is None:
        return "no selections yet"
    return f"{counters['hit_rate']:.1%} of {counters['selections']}"


def status_text(snap: Any, width: int | None = None) -> str:
    """The served models for people; width: fit the devices' table in that many columns (None: as wide
    as it comes)."""
    if not snap.servers:
        return "no model is being served ('moeplug serve NAME' starts one)"
    rows = []
    for s in snap.servers:
        cache = cache_summary(s.record.cache)
        counters = s.cache_counters.to_json() if s.cache_counters else None
        state = s.state if s.model_present else f"{s.state}, model file gone"
        hit_rate = _hit_rate_text(counters, "--metrics" in s.record.args)
        rows.append([s.name, s.record.url, s.record.pid, state, cache, hit_rate, _vram_text(s), s.record.log])
    lines = [table(["name", "url", "pid", "state", "expert cache", "measured hit rate", "VRAM of budget", "log"], rows,
                   "llrllrrl")]
    lines += [wrap_lines(f"{s.name}: {s.state}: {s.state_why}", width) for s in snap.servers if s.state_why]
    lines += [devices_status_text(snap.servers, width)] if any(s.devices for s in snap.servers) else []
    lines += [_traffic_text(s) for s in snap.servers if s.traffic and s.traffic.requests]
    lines += [f"{s.name}: {s.placement_why}" for s in snap.servers if s.placement_why]
    return "\n".join(lines)


def devices_status_text(servers: list[Any], width: int | None = None) -> str:
    """A row per device of each served model whose plan splits its layers over several: where the
    device is (this machine, or its rpc-server), its blocks, whole layers, slots and budget; in
    `width` columns, each device's figures under its name where the table is wider."""
    head = ["model", "device", "where", "blocks", "whole layers", "slots", "budget"]
    rows = [[s.name, d["device"], d["endpoint"] or "this machine", describe_blocks(d["blocks"], d["output"]),
             f"{d['whole_layers']} of {d['moe_layers']}", str(d["slots"]), human_bytes(d["budget_bytes"])]
            for s in servers for d in s.devices]
    text = table(head, rows, "lllllrr")
    if width is None or max(len(line) for line in text.splitlines()) <= width:
        return text
    return fitted_table(["device", "where, blocks, whole layers, slots, budget"],
                        [[f"{r[0]} {r[1]}", f"{r[2]}; blocks {r[3]}; {r[4]} whole; {r[5]} slots; budget {r[6]}"]
                         for r in rows], width)


def _traffic_text(s: Any) -> str:
    """A served model's requests beside the workload its plan weighs."""
    if not s.plan:
        return f"{s.name}: served {s.traffic.summary()}"
    plan = s.plan
    source = {"learned": "learned from its traffic", "asked": "set by hand",
              "default": f"the defaults; 'moeplug reprofile {s.name}' learns them"}[plan.workload_source]
    return (f"{s.name}: served {s.traffic.summary()}; planned for {plan.prefill_weight:g} and "
            + (f"prompts of {plan.prompt_tokens} tokens" if plan.prompt_tokens else "the profile's prompts")
            + f" ({source})")


def _vram_text(s: Any) -> str:
    """What the server holds on the GPU against its plan's budget ("-": no NVIDIA GPU sees it)."""
    if s.vram_bytes is None:
        return "-"
    used = f"{s.vram_bytes / MIB:.0f} MiB"
    if not s.vram_budget_bytes:
        return used
    over = s.vram_bytes - s.vram_budget_bytes
    return f"{used} of {s.vram_budget_bytes / MIB:.0f}" + (f" ({over / MIB:.0f} over)" if over > 0 else "")


def cmd_status(args: argparse.Namespace) -> int:
    from moeplug.serving.monitor import snapshot

    return Output.for_args(args).result(snapshot(), lambda snap: status_text(snap, terminal_width()))


@dataclass
class Listing:
    models: list[Any]  # serving.installed.InstalledModel

    def to_json(self) -> dict[str, Any]:
        return {"models": [m.to_json() for m in self.models]}


def _placement(m: Any) -> str:
    """What an installed model is served with, the check's ratio and when it ran."""
    return "its plan (not checked)" if m.verdict is None else m.verdict.served(m.plan.server_args)


def cmd_list(args: argparse.Namespace) -> int:
    from moeplug.serving.installed import list_installed

    def text(listing: Listing) -> str:
        models = listing.models
        if not models:
            return "no model installed ('moeplug install demo' makes one)"
        rows = [[m.name, describe_slots(m.plan.slots_per_layer, m.plan.n_expert), f"{m.plan.fit_fraction:.0%}",
                 m.plan.backend, _placement(m), m.path] for m in models]
        return table(["name", "slots", "fit", "plan", "served with", "model"], rows, "llrlll")

    return Output.for_args(args).result(Listing(list_installed()), text)


def register(sub: Any) -> None:
    """install, plan, serve, stop, status, list."""
    p = sub.add_parser("install", help="download, profile, plan and serve a MoE model (try: moeplug install demo)",
                       description="Take a model reference (demo, a recipe, user/repo[:QUANT], user/repo/file.gguf, "
                       "ollama:NAME[:TAG] or a path) to a running, verified, expert-cached llama-server.")
    p.add_argument("model")
    add_plan_options(p, BUDGET_HELP, CTX_HELP)
    add_backend(p)
    p.add_argument("--jobs", "-j", type=JOBS, default=0, help="compile jobs for the native build (0: one per core)")
    p.add_argument("--profile-tokens", type=TOKENS,
                   help="tokens generated per profiling prompt (default 256; demo 32; 0: the default)")
    p.add_argument("--prompts", default="codeish,chatty", help="bundled prompt sets (or .txt files) to profile with")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run the plan, the plan made with the fitted figures (where it differs) "
                        "and stock llama-server --fit at the same budget side by side on held-out prompts (a few "
                        "minutes, rounds repeated where the two fastest are close) and serve the fastest "
                        "(default: on where there is an NVIDIA GPU; --check forces it, --no-check skips it)")
    p.add_argument("--check-min", type=CHECK_MIN, metavar="RATIO",
                   help="the share of stock's speed the best plan must reach in the check to be served "
                        "(generated tokens a second with the plan's prompt tokens prefilled for each; default 1.0: "
                        "stock's placement where it is faster; 1.1: serve the slots only where they win by a tenth)")
    p.add_argument("--no-serve", action="store_true", help="stop after planning")
    add_prefill_weight(p)
    add_threads(p)
    add_ubatch(p)
    add_spec_options(p)
    add_serve_options(p)
    add_json(p)
    p.set_defaults(func=cmd_install)

    p = sub.add_parser("plan", help="slots per layer for a VRAM budget, and the flags to run with")
    p.add_argument("model", help="an installed name or a model reference")
    add_plan_options(p, BUDGET_HELP, CTX_HELP)
    p.add_argument("--profile", help="profile file (default: the model's stored profile, if any)")
    add_prefill_weight(p, keep=True)
    add_threads(p, keep=True)
    add_ubatch(p, keep=True)
    add_spec_options(p, shorthands=True, keep=True)
    add_json(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("serve", help="launch an installed model's llama-server and verify it",
                       description="Launch an installed model's llama-server (detached) and verify it, with the "
                                   "plan it was installed with; the options below re-plan it and keep that plan. "
                                   "A plan an older moeplug planner made is made again with its stored budget, "
                                   "context and choices.")
    p.add_argument("model", help="an installed name (see 'moeplug list')")
    add_plan_options(p, "re-plan for this budget, e.g. 12GiB, or 12GiB,12GiB for two GPUs (kept as the model's plan)",
                     "re-plan for this context size (kept as the model's plan)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="a re-plan is checked before it is served, as install checks (default: on where there is an "
                        "NVIDIA GPU; --check forces it, --no-check serves the new plan unchecked)")
    add_serve_options(p)
    add_prefill_weight(p, keep=True)
    add_threads(p, keep=True)
    add_ubatch(p, keep=True)
    add_spec_options(p, keep=True)
    add_json(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stop", help="stop a served model")
    p.add_argument("model", nargs="?")
    p.add_argument("--all", action="store_true")
    add_json(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("status", help="the models being served")
    add_json(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("list", help="the installed models")
    add_json(p)
    p.set_defaults(func=cmd_list)


BUDGET_HELP = ("GPU memory to plan for, e.g. 12GiB, or one per GPU in CUDA order, e.g. 12GiB,12GiB (default: "
               "each GPU's free VRAM from NVML)")
CTX_HELP = "context size to plan and serve (default 4096, or the model's training context when smaller)"
