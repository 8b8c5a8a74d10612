"""`moeplug demo`: the whole path on an embedded default, offline.

Generates a small synthetic MoE model, inspects it, builds the native llama.cpp (once; cached),
serves the model on 127.0.0.1 and asks it for a greedy completion.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from moeplug.errors import EXIT_OK
from moeplug.output import human_bytes, note, print_json
from moeplug.paths import data_dir, logs_dir

DEMO_PROMPT = "The three most useful things to know about mixture-of-experts models are"


def demo_model_path() -> Path:
    return data_dir() / "models" / "demo-qwen3moe-q8_0.gguf"


def ensure_demo_model() -> Path:
    from moeplug.synth import ModelSpec, make_model

    path = demo_model_path()
    if not path.exists():
        note(f"generating the demo model: {path}")
        make_model(ModelSpec(arch="qwen3moe", layers=4, experts=32, used=4, embd=256, expert_ff=256,
                             dtype="q8_0", seed=1234, name="moeplug-demo-qwen3moe"), path)
    return path


def run_demo(backend: str | None, jobs: int, n_predict: int) -> dict[str, Any]:
    from moeplug.model_inspect import inspect_model
    from moeplug.native.build import build, resolve_options
    from moeplug.server import start_server

    model = ensure_demo_model()
    info = inspect_model(model)
    note(f"model: {info.arch}, {len(info.moe_layers)} MoE layers x {info.n_expert} experts "
         f"({info.n_expert_used} used), {human_bytes(info.total_bytes)}")
    result = build(resolve_options(backend, stock=False, jobs=jobs, cuda_arch=None))
    log = logs_dir() / "demo-server.log"
    started = time.time()
    with start_server(result.binary("llama-server"), model, log) as server:
        server.wait_healthy()
        reply = server.complete(DEMO_PROMPT, n_predict=n_predict)
    return {
        "model": str(model),
        "inspect": info.to_json(),
        "build_id": result.build_id,
        "server_log": str(log),
        "prompt": DEMO_PROMPT,
        "completion": reply.get("content", ""),
        "tokens": reply.get("tokens", []),
        "seconds": round(time.time() - started, 2),
    }


def cmd_demo(args: argparse.Namespace) -> int:
    doc = run_demo(args.backend, args.jobs, args.n_predict)
    if args.json:
        print_json(doc)
        return EXIT_OK
    print(f"model    {doc['model']}")
    print(f"build    {doc['build_id']}")
    print(f"prompt   {doc['prompt']!r}")
    print(f"reply    {doc['completion']!r}  (random weights: the words mean nothing)")
    print(f"served, answered and stopped in {doc['seconds']} s; server log: {doc['server_log']}")
    return EXIT_OK


def add_demo_command(sub: Any) -> None:
    p = sub.add_parser("demo", help="offline end-to-end run on a built-in synthetic model")
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--cpu", dest="backend", action="store_const", const="cpu")
    backend.add_argument("--cuda", dest="backend", action="store_const", const="cuda")
    p.add_argument("--jobs", "-j", type=int, default=0, help="compile jobs for the native build")
    p.add_argument("-n", "--n-predict", type=int, default=24, help="tokens to generate")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo, backend=None)
