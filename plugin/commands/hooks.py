"""`moeplug hook llama-server | llama-swap | list | remove | watch`: argument parsing and printing;
the work is in moeplug.hooks. Registered by `add_hook_commands(sub)`."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moeplug.core.errors import EXIT_USAGE, MoeplugError
from moeplug.commands.options import COUNT, PORT, SECONDS, TTL
from moeplug.core.output import Output, table

EXAMPLES = """examples:
  moeplug hook llama-server --preset ~/router.ini     one [section] per installed model
  moeplug hook llama-server --print                   the sections, the preset not written
  moeplug hook llama-swap --config-dir ~/llama-swap.d writes ~/llama-swap.d/moeplug.yaml
  moeplug hook llama-swap --file ~/llama-swap.yaml    a marked block inside a single config
  moeplug hook ollama                                 Ollama runs moeplug's llama-server, every model its profile
  moeplug hook list                                   the hooks moeplug keeps current
  moeplug hook remove ~/router.ini                    takes moeplug's part out again
  moeplug hook remove ollama                          gives Ollama its bundled llama-server back
  moeplug hook watch                                  keep them current when files change (a user service)
"""


def _installed(args: argparse.Namespace) -> list[Any]:
    """The installed models, plans an older planner made made again first (what the proxy will start)."""
    from moeplug.operations.actions import installed_up_to_date

    return installed_up_to_date(Output.for_args(args).progress)


def _commands(args: argparse.Namespace) -> list[Any]:
    """What the proxy will start, each model's plan file (which its command names) written in moeplug's
    store, so that a printed section or entry runs as printed."""
    from moeplug.hooks.command import model_commands
    from moeplug.hooks.plan_files import write_plan_files

    models = _installed(args)
    write_plan_files(models)
    return model_commands(models)


def _report_text(record: Any, changed: bool, file: str) -> str:
    state = "wrote" if changed else "up to date:"
    return (f"{state} {file} ({len(record.models)} model{'s' if len(record.models) != 1 else ''}: "
            f"{', '.join(record.models) or 'none yet; installs add them'})\n"
            "moeplug keeps it current on install, re-plan and profile change ('moeplug hook list', 'moeplug hook remove')")


def _report(args: argparse.Namespace, record: Any, changed: bool, extra: dict[str, Any], after: str = "") -> int:
    from moeplug.hooks.maintain import hook_file

    doc = {"hook": asdict(record), "file": str(hook_file(record.target, Path(record.path))), "changed": changed,
           **extra}
    return Output.for_args(args).result(doc, lambda d: _report_text(record, changed, d["file"]) + after)


def cmd_llama_server(args: argparse.Namespace) -> int:
    from moeplug.hooks import llama_server_presets as presets
    from moeplug.hooks.maintain import add_hook

    if args.print:
        commands = _commands(args)
        return Output.for_args(args).result({"sections": {c.name: presets.section(c) for c in commands}},
                                            lambda _: presets.render(commands).rstrip("\n"))
    if not args.preset:
        raise MoeplugError("hook llama-server: give --preset FILE (or --print)", EXIT_USAGE)
    record, changed = add_hook("llama-server", Path(args.preset), _installed(args))
    command = presets.router_command(_commands(args), Path(record.path), args.models_max, args.port)
    after = ("\nrun the router with moeplug's patched llama-server (its children run the same binary):\n"
             f"  {command}") if command else ""
    return _report(args, record, changed, {"router_command": command}, after)


def cmd_llama_swap(args: argparse.Namespace) -> int:
    from moeplug.hooks import llama_swap
    from moeplug.hooks.maintain import add_hook

    schema = Path(args.schema) if args.schema else None
    if args.print:
        doc = llama_swap.fragment(_commands(args), args.ttl if args.ttl is not None else llama_swap.DEFAULT_TTL)
        llama_swap.validate(doc, schema)
        return Output.for_args(args).result(doc, lambda d: llama_swap.render(d).rstrip("\n"))
    if bool(args.config_dir) == bool(args.file):
        raise MoeplugError("hook llama-swap: give --config-dir DIR or --file PATH (or --print)", EXIT_USAGE)
    target, path = ("llama-swap", args.config_dir) if args.config_dir else ("llama-swap-file", args.file)
    record, changed = add_hook(target, Path(path), _installed(args), ttl=args.ttl, schema=schema)
    return _report(args, record, changed, {},
                   "\nllama-swap reads it on start; with -watch-config (or a SIGHUP) it reloads it")


def cmd_ollama(args: argparse.Namespace) -> int:
    from moeplug.hooks import ollama
    from moeplug.hooks.maintain import add_ollama_hook

    out = Output.for_args(args)
    install = ollama.find_install(Path(args.ollama_dir) if args.ollama_dir else None)
    models = _installed(args)
    record, next_step = add_ollama_hook(install, models, out.progress)
    doc = {"hook": asdict(record), "file": str(install.lib_dir / ollama.SERVER),
           "environment": ollama.environment(models), "remote_devices": ollama.rpc_environment(models)[1],
           "next": next_step}
    return out.result(doc, lambda d: (f"Ollama at {install.lib_dir} now runs moeplug's llama-server; every model "
                                      f"finds its profile and slots in {d['environment']['LLAMA_ARG_MOE_CACHE_PROFILE']}"
                                      f" ({len(record.models)} installed: {', '.join(record.models) or 'none yet'})\n"
                                      f"{next_step}"))


def _list_text(records: list[Any]) -> str:
    from moeplug.hooks.maintain import hook_file, hook_state

    if not records:
        return ("moeplug maintains no hook ('moeplug hook llama-server --preset FILE' or 'moeplug hook llama-swap "
                "--config-dir DIR' adds one)")
    rows = [[r.target, str(hook_file(r.target, Path(r.path))), ", ".join(r.models) or "-",
             time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated)), hook_state(r)]
            for r in records]
    return table(["target", "file", "models", "updated", "state"], rows, "lllll")


def cmd_list(args: argparse.Namespace) -> int:
    from moeplug.hooks.maintain import hook_file, hook_state
    from moeplug.hooks.store import read_hooks

    records = read_hooks()
    doc = {"hooks": [asdict(r) | {"file": str(hook_file(r.target, Path(r.path))), "state": hook_state(r)}
                     for r in records]}
    return Output.for_args(args).result(doc, lambda _: _list_text(records))


def cmd_remove(args: argparse.Namespace) -> int:
    from moeplug.hooks.maintain import find, remove_hook
    from moeplug.hooks.store import read_hooks

    if args.all == bool(args.path):
        raise MoeplugError("hook remove: give the hook's path (see 'moeplug hook list') or --all", EXIT_USAGE)
    if args.path == "ollama" and not Path(args.path).exists():
        records = [r for r in read_hooks() if r.target == "ollama"]
        if not records:
            raise MoeplugError("moeplug maintains no ollama hook ('moeplug hook list')")
    else:
        records = read_hooks() if args.all else [find(None, Path(args.path))]
    for r in records:
        remove_hook(r)

    def text(_: Any) -> str:
        lines = []
        for r in records:
            what = "restored Ollama's bundled files in" if r.target == "ollama" else f"removed the {r.target} hook at"
            lines.append(f"{what} {r.path}" + (f" ({r.error})" if r.target == "ollama" and r.error else ""))
        return "\n".join(lines)
    return Output.for_args(args).result({"removed": [asdict(r) for r in records]}, text)


def cmd_watch(args: argparse.Namespace) -> int:
    from moeplug.hooks.store import read_hooks
    from moeplug.operations.watch import watch_store
    from moeplug.serving.installed import installed_dir
    from moeplug.core.output import Output
    from moeplug.core.progress import Note

    out = Output.for_args(args)
    watcher = watch_store(debounce=args.debounce, progress=out.progress)
    out.progress(Note(f"watching {installed_dir()} and the profiles for {len(read_hooks())} hook(s); Ctrl-C stops"))
    try:
        while True:
            time.sleep(3600)
    finally:
        watcher.stop()


def add_hook_commands(sub: Any) -> None:
    hook = sub.add_parser("hook", help="keep model-swap proxies (llama-server router, llama-swap) configured",
                          description="Write moeplug's installed models, with their planned flags, into a "
                          "llama-server router preset or a llama-swap config, and keep them current.",
                          epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    hsub = hook.add_subparsers(dest="hook_command", metavar="HOOK_COMMAND", required=True)  # parsers of hook's class

    p = _command(hsub, "llama-server", "an INI preset for llama-server --models-preset (router mode)", cmd_llama_server)
    p.add_argument("--preset", help="the preset file to write or update (other sections are kept byte for byte)")
    p.add_argument("--print", action="store_true", help="print moeplug's sections, write no preset (the plans' files they name are written in moeplug's store)")
    p.add_argument("--models-max", type=COUNT, default=1, help="for the printed router command (default 1)")
    p.add_argument("--port", type=PORT, default=8080, help="for the printed router command (default 8080)")

    p = _command(hsub, "llama-swap", "llama-swap models: DIR/moeplug.yaml, or a block in one config file",
                 cmd_llama_swap)
    p.add_argument("--config-dir", help="llama-swap's -config-dir: writes DIR/moeplug.yaml")
    p.add_argument("--file", help="a single llama-swap config: moeplug's entries between marker comments")
    p.add_argument("--ttl", type=TTL, help="seconds idle before llama-swap unloads a model (default 300; 0: never)")
    p.add_argument("--schema", help="llama-swap's config-schema.json to validate against")
    p.add_argument("--print", action="store_true", help="print the fragment, write no config (the plans' files it names are written in moeplug's store)")

    p = _command(hsub, "ollama", "Ollama runs moeplug's llama-server; every model finds its profile and slots",
                 cmd_ollama)
    p.add_argument("--ollama-dir", help="Ollama's install folder (holding lib/ollama) or its lib/ollama "
                   "(default: from 'ollama' on PATH)")

    _command(hsub, "list", "the hooks moeplug maintains", cmd_list)
    p = _command(hsub, "remove", "take moeplug's part out of a hook's file and stop maintaining it", cmd_remove)
    p.add_argument("path", nargs="?", help="the hook's path as 'moeplug hook list' shows it, 'ollama' (or --all)")
    p.add_argument("--all", action="store_true")

    p = _command(hsub, "watch", "regenerate the hooks when installed models or profiles change on disk", cmd_watch,
                 json=False)
    p.add_argument("--debounce", type=SECONDS, default=0.3, help="seconds of quiet before regenerating (default 0.3)")


def _command(hsub: Any, name: str, help: str, func: Any, json: bool = True) -> argparse.ArgumentParser:
    p = hsub.add_parser(name, help=help)
    if json:
        p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=func)
    return p


register = add_hook_commands  # moeplug.commands.main.COMMAND_MODULES
