"""`moeplug install | plan | serve | stop | status | list`: the commands around a served model."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moeplug.errors import EXIT_ERROR, EXIT_OK, MoeplugError
from moeplug.output import human_bytes, print_json, table
from moeplug.plan import Plan, describe_slots, parse_size


def _budget(args: argparse.Namespace) -> int | None:
    return parse_size(args.vram_budget) if args.vram_budget else None


def print_plan(plan: dict[str, Any]) -> None:
    p = plan
    rows = [
        ["VRAM budget", human_bytes(p["vram_budget_bytes"]) if p["vram_budget_bytes"] else "no GPU"],
        ["non-expert weights", human_bytes(p["non_expert_vram_bytes"])],
        [f"KV cache ({p['ctx']} tokens)", human_bytes(p["kv_cache_bytes"])],
        ["compute buffer + CUDA pool", human_bytes(p["compute_bytes"])],
        ["safety margin", human_bytes(p["margin_bytes"])],
        ["one slot (all MoE layers)", human_bytes(p["bytes_per_slot"])],
        ["slots", f"{describe_slots(p['slots_per_layer'], p['n_expert'])}, {p['fit_fraction']:.0%} of experts"],
        ["experts in VRAM", human_bytes(p["expert_vram_bytes"])],
        ["predicted hit rate", f"{p['predicted_hit_rate']:.1%}" if p["predicted_hit_rate"] is not None else "no profile"],
        ["stock -ncmoe for this budget", str(p["stock_ncmoe"]) if p["stock_ncmoe"] is not None else "-"],
        ["modelled CPU time per token", _host_ms(p)],
        ["load mode", p["load_mode"]],
    ]
    print(table(["plan", ""], rows, "lr"))
    print("server args: " + shlex.join(p["server_args"]))  # quoted: -ot patterns hold | and ( )
    for n in p["notes"]:
        print(f"note: {n}")
    for w in p["warnings"]:
        print(f"WARNING: {w}")


def _host_ms(p: dict[str, Any]) -> str:
    if p.get("modelled_host_ms") is None:
        return "-"
    return f"{p['modelled_host_ms']:.2f} ms (stock -ncmoe: {p['stock_modelled_host_ms']:.2f} ms)"


def cmd_plan(args: argparse.Namespace) -> int:
    from moeplug.install import list_installed, locate, require_moe
    from moeplug.model_inspect import inspect_model
    from moeplug.gpu import free_vram_bytes
    from moeplug.plan import available_ram_bytes, make_plan
    from moeplug.profile.format import model_fingerprint
    from moeplug.profile.runner import default_profile_path

    installed = {m.name: m for m in list_installed()}
    path = Path(installed[args.model].path) if args.model in installed else locate(args.model, download=False).path
    info = inspect_model(path)
    require_moe(info)
    profile = Path(args.profile) if args.profile else default_profile_path(model_fingerprint(path))
    budget = _budget(args)
    plan: Plan = make_plan(info, args.ctx, budget if budget is not None else free_vram_bytes(),
                           profile if profile.exists() else None, available_ram_bytes())
    if args.json:
        print_json(plan.to_json())
    else:
        print_plan(plan.to_json())
    return EXIT_OK


def _print_served(doc: dict[str, Any]) -> None:
    srv = doc["server"]
    cache = srv.get("cache") or {}
    if cache.get("engaged"):
        lo, hi = cache.get("slots_min") or cache["slots"], cache["slots"]
        slots = f"{hi}" if lo == hi else f"{lo}-{hi}"
        whole = f" ({cache['whole_layers']} whole)" if cache.get("whole_layers") else ""
        print(f"expert cache: {cache['layers']} layers x {slots} slots{whole}, {cache['mib_uploaded']:.2f} MiB "
              f"on {cache['device']} in {cache['seconds']:.2f} s")
    elif cache:
        print(f"expert cache: not engaged ({cache['reason']})")
    print(f"serving {doc['name']} at {srv['url']} (pid {srv['pid']}, log {srv['log']})")
    print(f"query:  curl {srv['url']}/v1/chat/completions -H 'Content-Type: application/json' "
          "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")
    print(f"stop:   moeplug stop {doc['name']}")


def cmd_install(args: argparse.Namespace) -> int:
    from moeplug.install import install

    doc = install(args.model, ctx=args.ctx, vram_budget=_budget(args), backend=args.backend, jobs=args.jobs,
                  profile_tokens=args.profile_tokens, prompt_sets=[s for s in args.prompts.split(",") if s],
                  serve=not args.no_serve, port=args.port, allow_fallback=args.allow_fallback, metrics=args.metrics)
    if args.json:
        print_json(doc)
        return EXIT_OK
    print(f"installed {doc['name']}: {doc['model']}")
    print(f"profile  {doc['profile']}")
    print_plan(doc["plan"])
    if doc["server"]:
        _print_served(doc)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from moeplug.install import serve_installed

    srv = serve_installed(args.model, port=args.port, vram_budget=_budget(args), ctx=args.ctx,
                          allow_fallback=args.allow_fallback, metrics=args.metrics)
    doc = {"name": args.model, "server": asdict(srv) | {"url": srv.url}}
    if args.json:
        print_json(doc)
    else:
        _print_served(doc)
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from moeplug.serving import read_records, stop

    names = [r.name for r in read_records()] if args.all else [args.model]
    if not names or names == [None]:
        raise MoeplugError("name a served model, or pass --all")
    stopped = [n for n in names if stop(n)]
    if args.json:
        print_json({"stopped": stopped})
    else:
        for n in names:
            print(f"{n}: {'stopped' if n in stopped else 'was not running'}")
    return EXIT_OK if args.all or stopped else EXIT_ERROR


def _hit_rate_text(counters: dict[str, Any] | None) -> str:
    if counters is None:
        return "- (serve with --metrics)"
    if counters["hit_rate"] is None:
        return "no selections yet"
    return f"{counters['hit_rate']:.1%} of {counters['selections']}"


def cmd_status(args: argparse.Namespace) -> int:
    from moeplug.monitor import snapshot

    snap = snapshot()
    if args.json:
        print_json(snap.to_json())
        return EXIT_OK
    if not snap.servers:
        print("no model is being served ('moeplug serve NAME' starts one)")
        return EXIT_OK
    rows = []
    for s in snap.servers:
        c = s.record.cache or {}
        cache = f"{c['layers']}x{c['slots']} on {c['device']}" if c.get("engaged") else ("off" if not c else "not engaged")
        counters = s.cache_counters.to_json() if s.cache_counters else None
        rows.append([s.name, s.record.url, s.record.pid, s.state, cache, _hit_rate_text(counters), s.record.log])
    print(table(["name", "url", "pid", "state", "expert cache", "measured hit rate", "log"], rows, "llrllrl"))
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from moeplug.install import list_installed

    models = list_installed()
    if args.json:
        print_json({"models": [asdict(m) for m in models]})
        return EXIT_OK
    if not models:
        print("no model installed ('moeplug install demo' makes one)")
        return EXIT_OK
    rows = [[m.name, describe_slots(m.plan["slots_per_layer"], m.plan["n_expert"]), f"{m.plan['fit_fraction']:.0%}",
             m.plan["backend"], m.path] for m in models]
    print(table(["name", "slots", "fit", "plan", "model"], rows, "llrll"))
    return EXIT_OK


def add_install_commands(sub: Any) -> None:
    p = sub.add_parser("install", help="download, profile, plan and serve a MoE model (try: moeplug install demo)",
                       description="Take a model reference (demo, a recipe, user/repo[:QUANT], user/repo/file.gguf, "
                       "ollama:NAME[:TAG] or a path) to a running, verified, expert-cached llama-server.")
    p.add_argument("model")
    _plan_args(p)
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--cpu", dest="backend", action="store_const", const="cpu")
    backend.add_argument("--cuda", dest="backend", action="store_const", const="cuda")
    p.add_argument("--jobs", "-j", type=int, default=0, help="compile jobs for the native build")
    p.add_argument("--profile-tokens", type=int, help="tokens generated per profiling prompt (default 256; demo 32)")
    p.add_argument("--prompts", default="codeish,chatty", help="bundled prompt sets (or .txt files) to profile with")
    p.add_argument("--no-serve", action="store_true", help="stop after planning")
    _serve_args(p)
    p.set_defaults(func=cmd_install, backend=None)

    p = sub.add_parser("plan", help="slots per layer for a VRAM budget, and the flags to run with")
    p.add_argument("model", help="an installed name or a model reference")
    _plan_args(p)
    p.add_argument("--profile", help="profile file (default: the model's stored profile, if any)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("serve", help="launch an installed model's llama-server and verify it")
    p.add_argument("model", help="an installed name (see 'moeplug list')")
    p.add_argument("--vram-budget", help="re-plan for this budget (kept as the model's plan)")
    p.add_argument("--ctx", type=int, help="re-plan for this context size (kept as the model's plan)")
    _serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stop", help="stop a served model")
    p.add_argument("model", nargs="?")
    p.add_argument("--all", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("status", help="the models being served")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("list", help="the installed models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vram-budget", help="GPU memory to plan for, e.g. 12GiB (default: free VRAM from NVML)")
    p.add_argument("--ctx", type=int, default=4096, help="context size to plan and serve (default 4096)")


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--allow-fallback", action="store_true", help="serve without the cache when it cannot engage")
    p.add_argument("--metrics", action="store_true",
                   help="count slot hits on llama-server's /metrics ('moeplug status' shows the measured hit rate; "
                        "costs a small read per MoE layer and batch)")
    if not any(a.dest == "json" for a in p._actions):
        p.add_argument("--json", action="store_true")
