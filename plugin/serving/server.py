"""Start, query and stop a llama-server process.

The server is started from an argument list (never a shell string) on 127.0.0.1, its log goes
to a file, and it counts as up only once `/health` answers ok. `start_server` is the one place
that checks the binary and the port and assembles llama-server's argv: the tests and benchmarks
own the process it returns; `moeplug.serving.launch.launch_verified` starts it detached for a served model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.core.runlog import log_tail
from moeplug.serving import client

HOST = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::")


def client_host(host: str = HOST) -> str:
    """Where this machine reaches a server listening on host (every address: its loopback)."""
    return {"0.0.0.0": HOST, "::": "::1"}.get(host, host)


def url_of(host: str, port: int) -> str:
    h = client_host(host)
    return f"http://{'[' + h + ']' if ':' in h else h}:{port}"


def exposure_warning(host: str) -> str | None:
    """The warning for a server that listens beyond this machine, or None on loopback."""
    import ipaddress

    if ipaddress.ip_address(host).is_loopback:
        return None
    where = "every address of this machine" if host in WILDCARDS else host
    return (f"warning: llama-server listens on {where}: other machines can reach it, and it has no API key; "
            f"leave --host out to keep it on 127.0.0.1")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = HOST) -> bool:
    h = client_host(host)
    with socket.socket(socket.AF_INET6 if ":" in h else socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((h, port)) == 0


def health(port: int, host: str = HOST) -> dict[str, Any] | None:
    """llama-server's /health answer on host:port (host: where it listens), or None when nothing answers."""
    return client.health(url_of(host, port))


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    args: list[str]
    host: str = HOST

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def health(self) -> dict[str, Any] | None:
        return health(self.port, self.host)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise MoeplugError(self._exit_reason(rc))
            h = self.health()
            if h and h.get("http_status") == 200 and h.get("status") == "ok":
                return
            time.sleep(0.2)
        self.stop()
        raise MoeplugError(f"llama-server did not become healthy in {timeout:.0f} s (log: {self.log_path})")

    def _exit_reason(self, rc: int) -> str:
        """Why the server exited while loading, in one line naming its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        if "couldn't bind HTTP server socket" in text:
            return (f"port {self.port} on {self.host} was taken before llama-server could listen on it; pick another "
                    f"with --port, or leave it out for a free one (log: {self.log_path})")
        from moeplug.serving.liveness import last_error_line

        how = f"was killed (signal {-rc})" if rc < 0 else f"exited with code {rc}"
        why = last_error_line(self.log_path) or log_tail(self.log_path) or "(nothing logged)"
        return f"llama-server {how} while loading: {why} (log: {self.log_path})"

    def complete(self, prompt: str | Sequence[int | str], n_predict: int = 16, seed: int = 42, **params: Any) -> dict[str, Any]:
        """A greedy /completion; the reply includes the generated token ids."""
        return client.complete(self.url, prompt, n_predict, seed, **params)

    def stop(self, timeout: float = 10) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_argv(binary: Path, model: Path, port: int | str, extra_args: list[str], ctx: int | None = None,
                threads: int | None = None, host: str = HOST) -> list[str]:
    """llama-server on 127.0.0.1 (or an address the user gave explicitly): the one place its
    command line is formed (port may be a placeholder such as llama-swap's "${PORT}")."""
    return [str(binary), "-m", str(model), "--host", host, "--port", str(port),
            *(["-c", str(ctx)] if ctx is not None else []), "--no-webui",
            *(["-t", str(threads)] if threads else []), *extra_args]


def start_server(binary: Path, model: Path, log_path: Path, extra_args: list[str] | None = None,
                 port: int | None = None, ctx: int | None = 2048, threads: int | None = None, *,
                 detached: bool = False, env: dict[str, str] | None = None, host: str = HOST) -> Server:
    """Start llama-server on 127.0.0.1, or host (port None: a free one); call wait_healthy() before using it.
    ctx None: no -c (extra_args has it). detached: in its own session, so it outlives this process.
    env: added to this process's environment."""
    if not binary.exists():
        raise MoeplugError(f"{binary}: no llama-server there (run 'moeplug native build')")
    if not model.exists():
        raise MoeplugError(f"{model}: no such model file (deleted or moved?)")
    port = port or free_port()
    if port_in_use(port, host):
        raise MoeplugError(f"port {port} on {host} is already in use; pick another with --port")
    args = server_argv(binary, model, port, list(extra_args or []), ctx, threads, host)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=detached, env={**os.environ, **env} if env else None)
    return Server(proc=proc, port=port, log_path=log_path, args=args, host=host)
