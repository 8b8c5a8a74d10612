"""Serving this machine's devices to another machine's llama-server (`moeplug rpc-server`): the
patched build's ggml-rpc-server (llama.cpp's tools/rpc), in the foreground, on exactly the address
the user names.

ggml-rpc-server binds one IPv4 address (it reads it with inet_addr: names and IPv6 are refused
there) and serves one client at a time. It has no authentication, so the default is 127.0.0.1, a
wildcard is bound only where named, and machine.rpc.exposure's warning goes out beyond loopback and
private networks. The address and the port are tried here first (bound with SO_REUSEADDR, as the
server binds them), so that an address not of this machine or a port in use is a one-line error
before anything starts.

The server prints the devices it serves, but flushes its output only on a terminal: it writes to a
pseudo-terminal, whose lines a thread copies into its log. It is up once it printed its transport
(the line before it binds) and its port is bound (a bind here fails). A stop signal (SIGINT, SIGTERM,
SIGHUP) is forwarded to it; its ending on one is a clean stop, its ending by itself an error.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import ipaddress
import os
import pty
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from moeplug.machine.backend import Backend, backend as backend_of
from moeplug.core.errors import MoeplugError
from moeplug.core.paths import logs_dir
from moeplug.core.progress import Note, ProgressFn, silent
from moeplug.machine.probes import usable_cores
from moeplug.machine.rpc import DEFAULT_RPC_PORT, device_line, exposure

BINARY = "ggml-rpc-server"
DEFAULT_HOST = "127.0.0.1"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
START_TIMEOUT_S = 120.0  # a GPU's backend can take a while to initialise


@dataclass(frozen=True)
class ServedDevice:
    """A device the server offers, as it names it (CPU, CUDA0, ...)."""

    name: str
    description: str
    total_bytes: int
    free_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def listen_address(host: str) -> str:
    """The address as ggml-rpc-server binds it: an IPv4 address, or a one-line error."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise MoeplugError(f"--host {host!r}: not an IPv4 address (ggml-rpc-server binds one IPv4 address of this "
                           f"machine, e.g. 127.0.0.1 or 192.168.1.20; 0.0.0.0: every one)") from None


def _try_bind(host: str, port: int) -> OSError | None:
    """Bind host:port as the server does (SO_REUSEADDR) and let go: the error, or None where it bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def check_listen(host: str, port: int, progress: ProgressFn = silent) -> None:
    """Before starting: the address is this machine's (else a one-line error), the warning where it
    reaches beyond loopback and private networks (a Note), and the port free (else a one-line error)."""
    host = listen_address(host)
    exc = _try_bind(host, 0)
    if exc is not None:
        why = "not an address of this machine" if exc.errno == errno.EADDRNOTAVAIL else exc.strerror or str(exc)
        raise MoeplugError(f"--host {host}: {why} (ggml-rpc-server binds one of this machine's addresses)")
    warning = exposure(host)
    if warning:
        progress(Note(warning))
    exc = _try_bind(host, port)
    if exc is None:
        return
    if exc.errno == errno.EADDRINUSE:
        raise MoeplugError(f"port {port} on {host} is already in use; pick another with --port")
    if exc.errno == errno.EACCES:
        raise MoeplugError(f"port {port} on {host}: ports below 1024 need root; pick another with --port")
    raise MoeplugError(f"cannot listen on {host}:{port} ({exc.strerror or exc})")


def served_build(progress: ProgressFn = silent) -> Any:
    """The build whose ggml-rpc-server serves (a moeplug.native.BuildResult): a patched, unsanitized
    build here that has one, of the backend `moeplug native build` would choose here (CUDA where nvcc
    and a GPU are: a CPU build would serve the CPU alone), the current one first, else the newest;
    where there is none, the current one, made now."""
    from moeplug.native.build import build, build_id, resolve_options
    from moeplug.native.lock import load_spec

    opts = resolve_options(None, stock=False, jobs=0, cuda_arch=None)
    found = rpc_builds(opts.backend)
    if found:
        current = build_id(load_spec(), opts)
        return max(found, key=lambda b: (b.build_id == current, b.path.stat().st_mtime))
    progress(Note(f"no build here has {BINARY}: building one ('moeplug native build')"))
    return build(opts, progress=progress)


def rpc_builds(backend: Backend | str | None = None) -> list[Any]:
    """The patched, unsanitized builds here that have ggml-rpc-server (of `backend`; None: any)."""
    from moeplug.native.build import installed_builds

    return [b for b in installed_builds() if not b.manifest.get("stock") and not b.manifest.get("sanitize")
            and (backend is None or b.backend is backend_of(backend)) and b.binary(BINARY).exists()]


class _Output(threading.Thread):
    """Copies the server's pseudo-terminal into its log, keeping its first lines (what it serves)
    and its last (why it ended)."""

    HEAD = 64

    def __init__(self, fd: int, log_path: Path) -> None:
        super().__init__(daemon=True)
        self.fd, self.log_path = fd, log_path
        self.head: list[str] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=20)

    def run(self) -> None:
        rest = b""
        with open(self.log_path, "ab") as log:
            while True:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # EIO: the server's end closed
                    break
                if not chunk:
                    break
                chunk = chunk.replace(b"\r\n", b"\n")
                log.write(chunk)
                log.flush()
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    (self.head if len(self.head) < self.HEAD else self.tail).append(line.decode(errors="replace"))
        os.close(self.fd)

    def lines(self) -> list[str]:
        """What it printed that was kept: the first lines and the last."""
        return self.head + list(self.tail)


class RpcServer:
    """A started ggml-rpc-server: its process, where it listens, its build and its log."""

    def __init__(self, proc: subprocess.Popen[bytes], output: _Output, host: str, port: int, build_id: str) -> None:
        self.proc, self.output, self.host, self.port, self.build_id = proc, output, host, port, build_id

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.output.log_path

    def devices(self) -> list[ServedDevice]:
        """What it serves: the lines it printed under 'Devices:'."""
        lines = self.output.lines()
        start = next((i for i, line in enumerate(lines) if line.strip() == "Devices:"), len(lines))
        found = []
        for line in lines[start + 1:]:
            d = device_line(line)
            if d is None:
                break
            found.append(ServedDevice(*d))
        return found

    def use(self) -> str:
        """What the other machine runs to use it (every address: the one it reaches this machine at)."""
        host = "ADDRESS" if ipaddress.IPv4Address(self.host).is_unspecified else self.host
        return f"moeplug install MODEL --rpc {host}:{self.port}"

    def listening(self) -> bool:
        """It printed its transport (the line before it binds) and its port is bound."""
        if not any("transport" in line for line in self.output.head):
            return False
        exc = _try_bind(self.host, self.port)
        return exc is not None and exc.errno == errno.EADDRINUSE

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 10) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def exit_reason(self, rc: int, up: bool) -> str:
        """Why it ended by itself, in one line naming its log."""
        lines = [line.strip() for line in self.output.lines() if line.strip()]
        unknown = next((line for line in lines if line.startswith("error: unknown device:")), None)
        if unknown:
            available = [d[0] for d in map(device_line, self.output.lines()) if d]
            return (f"--device {unknown.split(':', 2)[2].strip()}: no such device here (available: "
                    f"{', '.join(available) or 'none'})")
        if not up and "Failed to create server socket" in lines:
            return f"{BINARY} could not listen on {self.endpoint}: taken since it was checked? (log: {self.log_path})"
        how = f"was killed (signal {-rc})" if rc < 0 else f"exited with code {rc}"
        when = "while serving" if up else "before it listened"
        return f"{BINARY} {how} {when}: {lines[-1] if lines else 'nothing printed'} (log: {self.log_path})"

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "host": self.host, "port": self.port,
                "devices": [d.to_json() for d in self.devices()], "build_id": self.build_id, "pid": self.proc.pid,
                "log": str(self.log_path), "use": self.use()}


def server_argv(binary: Path, host: str, port: int, devices: tuple[str, ...] = (), threads: int | None = None) -> list[str]:
    """ggml-rpc-server's command line; threads (its CPU device's) None: the physical cores this process
    may use, llama.cpp's default elsewhere (the server's own is 1)."""
    return [str(binary), "--host", host, "--port", str(port), "--threads", str(threads or usable_cores() or 1),
            *(["--device", ",".join(devices)] if devices else [])]


def launch(build: Any, host: str, port: int, devices: tuple[str, ...] = (), threads: int | None = None,
           log_path: Path | None = None) -> RpcServer:
    """Start the build's ggml-rpc-server on a pseudo-terminal, its output copied into the log
    (default: the logs folder's rpc-server-HOST-PORT.log). It is not up yet: see RpcServer.listening."""
    argv = server_argv(build.binary(BINARY), host, port, devices, threads)
    log_path = log_path or logs_dir() / f"rpc-server-{host}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"moeplug rpc-server: {' '.join(argv)}\n")
    master, child = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    except OSError as exc:
        os.close(master)
        raise MoeplugError(f"{argv[0]}: did not start ({exc.strerror or exc})") from None
    finally:
        os.close(child)
    output = _Output(master, log_path)
    output.start()
    return RpcServer(proc, output, host, port, build.build_id)


def _wait_up(server: RpcServer, timeout: float) -> bool:
    """True once it listens, False where it ended first; it is stopped and an error raised after `timeout`."""
    deadline = time.monotonic() + timeout
    while not server.listening():
        if server.proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            server.stop()
            raise MoeplugError(f"{BINARY} did not listen on {server.endpoint} in {timeout:.0f} s (log: {server.log_path})")
        time.sleep(0.05)
    return True


def serve(build: Any, host: str = DEFAULT_HOST, port: int = DEFAULT_RPC_PORT, devices: tuple[str, ...] = (),
          threads: int | None = None, on_up: Callable[[RpcServer], None] = lambda server: None,
          log_path: Path | None = None) -> RpcServer:
    """Run the build's ggml-rpc-server on host:port in the foreground until a stop signal, which is
    forwarded to it (check_listen comes first: this only starts it); `on_up` is called once it listens.
    Returns the stopped server; a one-line error where it did not start or ended by itself."""
    stops: list[int] = []
    started: list[RpcServer] = []

    def forward(signum: int, _frame: Any) -> None:
        stops.append(signum)
        for s in started:
            s.signal(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        server = launch(build, host, port, devices, threads, log_path)
        started.append(server)
        up = False
        if stops:  # a stop that came while it started
            server.signal(stops[0])
        elif _wait_up(server, START_TIMEOUT_S):
            up = True
            on_up(server)
        rc = server.proc.wait()
    except BaseException:
        for s in started:
            s.stop()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    server.output.join(timeout=5)
    if not stops:
        raise MoeplugError(server.exit_reason(rc, up))
    return server
