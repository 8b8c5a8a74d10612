"""`moeplug rpc-server`: serve this machine's devices to another machine's llama-server through
llama.cpp's RPC backend (moeplug.serving.rpc_server), in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from moeplug.commands.options import PORT, THREADS, add_json
from moeplug.core.errors import EXIT_OK, MoeplugError
from moeplug.core.output import Output, human_bytes
from moeplug.machine.rpc import DEFAULT_RPC_PORT


def rpc_address(text: str) -> str:
    """--host: an IPv4 address, as ggml-rpc-server binds it."""
    from moeplug.serving.rpc_server import listen_address

    try:
        return listen_address(text)
    except MoeplugError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--host ")) from None


def device_names(text: str) -> tuple[str, ...]:
    """--device: device names as llama.cpp gives them (CUDA0, CPU, ...), comma-separated."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or any(" " in n or "/" in n for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected device names, comma-separated (like CUDA0,CUDA1)")
    return names


def serving_text(server: Any) -> str:
    """One line: what it serves, and how the other machine uses it."""
    served = ", ".join(f"{d.name} ({d.description}, {human_bytes(d.total_bytes)})" for d in server.devices())
    tunnel = (f" (loopback: from another machine through 'ssh -L {server.port}:{server.host}:{server.port} THIS-MACHINE')"
              if server.host.startswith("127.") else "")
    return (f"serving {served or 'its devices'} on {server.endpoint}; on the other machine: {server.use()}{tunnel}; "
            f"Ctrl-C stops it")


def cmd_rpc_server(args: argparse.Namespace) -> int:
    from moeplug.serving.rpc_server import check_listen, serve, served_build

    out = Output.for_args(args)
    check_listen(args.host, args.port, out.progress)
    build = served_build(out.progress)

    def up(server: Any) -> None:
        out.result(server, serving_text)
        sys.stdout.flush()

    serve(build, args.host, args.port, args.device or (), args.threads, on_up=up)
    return EXIT_OK


def register(sub: Any) -> None:
    """rpc-server."""
    p = sub.add_parser(
        "rpc-server", help="serve this machine's devices to another machine's llama-server (llama.cpp RPC)",
        description="Run the patched build's ggml-rpc-server (built first where no build has one) in the "
        "foreground, so that another machine's 'moeplug install MODEL --rpc HOST:PORT' puts layers on this "
        "machine's devices: its GPUs, else its CPU. It has no authentication: whoever reaches the port runs code "
        "on those devices, so it listens on 127.0.0.1 unless --host names another address of this machine "
        "(a warning says when that is beyond loopback and private networks). Ctrl-C or SIGTERM stops it (exit 0). "
        "Exit codes: 0 stopped, 1 an error (the address or port taken, the server ended by itself), 2 a usage "
        "error.")
    p.add_argument("--host", type=rpc_address, default="127.0.0.1", metavar="ADDR",
                   help="the IPv4 address to listen on, one of this machine's (default 127.0.0.1: this machine "
                        "only; 0.0.0.0: every address)")
    p.add_argument("--port", type=PORT, default=DEFAULT_RPC_PORT, metavar="N",
                   help=f"the port, 1-65535 (default {DEFAULT_RPC_PORT}, rpc-server's own)")
    p.add_argument("--device", type=device_names, default=None, metavar="DEV[,DEV]",
                   help="the devices to serve, as llama.cpp names them (default: every GPU, else the CPU)")
    p.add_argument("--threads", "-t", type=THREADS, default=None, metavar="N",
                   help="threads of the CPU device, 1-4096 (default: the physical cores)")
    add_json(p, "once it listens, what it serves as JSON (endpoint, devices, build_id, pid, log, use)")
    p.set_defaults(func=cmd_rpc_server)
