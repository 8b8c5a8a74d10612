"""Remote devices through llama.cpp's RPC backend: the hosts a user names with `--rpc`, and what
each serves as llama.cpp itself sees it.

A remote box runs llama.cpp's rpc-server (`moeplug rpc-server` there, or the build's
`ggml-rpc-server`); the main box's llama-server adds its devices with `--rpc HOST:PORT,...`, and
llama.cpp puts them first in its device list (src/llama.cpp: "add RPC servers at the front of the
list"), named RPC0, RPC1, ... in the order given, one per device each server offers. moeplug asks
llama.cpp for that list (`llama-server --rpc ... --list-devices`: each device's name, endpoint,
total and free memory) rather than speaking the RPC protocol itself.

rpc-server has no authentication: whoever reaches its port can run code on its devices. So
`exposure` says when an address is neither loopback nor private, and moeplug never binds one to
any address but the one the user names (serving.rpc_server). An rpc-server serves one client at a
time: probing a host that a running llama-server holds waits for it, so nothing here probes a
served model's hosts.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moeplug.core.errors import MoeplugError
from moeplug.core.sizes import MIB

DEFAULT_RPC_PORT = 50052  # rpc-server's own default
PROBE_TIMEOUT_S = 10.0
# a device as llama.cpp lists one ("  RPC0: 127.0.0.1:50052 (24105 MiB, 24105 MiB free)": llama-server
# --list-devices; "  CPU: AMD EPYC (...)": ggml-rpc-server's own list)
_DEVICE_LINE = re.compile(r"^\s*(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")


@dataclass(frozen=True)
class RpcHost:
    """One `--rpc` entry: an rpc-server's address."""

    host: str
    port: int

    @property
    def endpoint(self) -> str:
        """As llama.cpp takes it: HOST:PORT, an IPv6 address in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RemoteDevice:
    """A device an rpc-server offers, as llama.cpp lists it."""

    name: str  # RPC0, RPC1, ...: llama.cpp's name, in the order of --rpc
    endpoint: str  # the rpc-server that offers it
    total_bytes: int
    free_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RemoteDevice:
        return cls(**doc)


def parse_rpc(text: str) -> tuple[RpcHost, ...]:
    """`--rpc HOST:PORT[,HOST:PORT...]` (a port left out: rpc-server's default), one-line errors for
    what llama.cpp would take badly: an empty entry, a port out of range, a host twice."""
    hosts: list[RpcHost] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise MoeplugError(f"--rpc {text!r}: an empty entry (HOST:PORT, comma-separated)")
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?|([^:\s\[\]]+)(?::(\d+))?", item)
        if not m:
            raise MoeplugError(f"--rpc {item!r}: expected HOST:PORT (an IPv6 address in brackets)")
        host, port = (m[1], m[2]) if m[1] else (m[3], m[4])
        number = int(port) if port else DEFAULT_RPC_PORT
        if not 1 <= number <= 65535:
            raise MoeplugError(f"--rpc {item!r}: port {number} is out of range (1-65535)")
        found = RpcHost(host, number)
        if found in hosts:
            raise MoeplugError(f"--rpc: {found.endpoint} given twice")
        hosts.append(found)
    return tuple(hosts)


def rpc_arg(hosts: tuple[RpcHost, ...] | list[str]) -> str:
    """llama-server's --rpc value."""
    return ",".join(h if isinstance(h, str) else h.endpoint for h in hosts)


def exposure(host: str) -> str | None:
    """Why an rpc-server at `host` may be reached by strangers (it has no authentication), or None
    where the address is loopback or private (a LAN). A name is judged by what it resolves to."""
    try:
        addresses = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addresses = {ipaddress.ip_address(a[4][0].split("%")[0]) for a in socket.getaddrinfo(host, None)}
        except OSError:
            return None  # not resolved: the probe says so
    if any(a.is_unspecified for a in addresses):
        where = "every address of this machine"
    else:
        public = sorted(str(a) for a in addresses if not (a.is_loopback or a.is_private or a.is_link_local))
        if not public:
            return None
        where = f"{host} ({', '.join(public)}), an address beyond this machine and its private network"
    return (f"warning: rpc-server on {where}: it has no authentication, and whoever reaches its port runs code "
            f"on its devices; keep it on loopback or a private network")


def device_line(line: str) -> tuple[str, str, int, int] | None:
    """A device as llama.cpp lists one: its name, description, total and free bytes; None for another line."""
    m = _DEVICE_LINE.match(line)
    return (m[1], m[2], int(m[3]) * MIB, int(m[4]) * MIB) if m else None


def no_answer(host: RpcHost, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing accepts a connection at the host's port (a connection opened and closed at once),
    or None where something does."""
    try:
        socket.create_connection((host.host, host.port), timeout=timeout).close()
    except socket.gaierror:
        return "does not resolve"
    except TimeoutError:
        return f"takes no connection in {timeout:g} s"
    except OSError as exc:
        return f"does not answer ({exc.strerror or exc})"
    return None


def reachable(host: RpcHost, timeout: float = PROBE_TIMEOUT_S) -> None:
    """A one-line error where nothing accepts a connection at the host's port."""
    why = no_answer(host, timeout)
    if why:
        raise MoeplugError(f"--rpc {host.endpoint}: the host {why}")


def check_hosts(endpoints: tuple[str, ...] | list[str]) -> None:
    """reachable() for each of these HOST:PORT entries: the one-line error before anything starts."""
    for host in parse_rpc(",".join(endpoints)) if endpoints else ():
        reachable(host)


def remote_devices(server: Path, hosts: tuple[RpcHost, ...], env: dict[str, str] | None = None,
                   timeout: float = PROBE_TIMEOUT_S) -> list[RemoteDevice]:
    """Every device the hosts offer, as llama.cpp lists them (`server`: a llama-server built with the
    RPC backend). One-line errors for a host that does not answer, a port that is not an rpc-server,
    a build without RPC."""
    if not hosts:
        return []
    for host in hosts:
        reachable(host, timeout)
    try:
        r = subprocess.run([str(server), "--rpc", rpc_arg(hosts), "--list-devices"], capture_output=True, text=True,
                           timeout=timeout * len(hosts), env=env)
    except subprocess.TimeoutExpired:
        raise MoeplugError(f"--rpc {rpc_arg(hosts)}: no device list in {timeout * len(hosts):g} s (a port that is not "
                           f"an rpc-server, or one another llama-server holds: rpc-server serves one client at a "
                           f"time)") from None
    text = r.stdout + r.stderr
    if "RPC not supported" in text or "failed to find RPC backend" in text:
        raise MoeplugError(f"{server}: a build without llama.cpp's RPC backend ('moeplug native build' makes one with it)")
    if r.returncode != 0:
        failed = re.search(r"(handshake failed|Failed to connect to|crashed or returned malformed)[^\n]*", text)
        why = failed[0].strip() if failed else f"llama-server exited {r.returncode}"
        raise MoeplugError(f"--rpc {rpc_arg(hosts)}: not an rpc-server of this llama.cpp ({why})")
    devices = [RemoteDevice(*d) for d in map(device_line, r.stdout.splitlines())
               if d is not None and re.fullmatch(r"RPC\d+", d[0])]
    missing = [h.endpoint for h in hosts if not any(d.endpoint == h.endpoint for d in devices)]
    if missing:
        raise MoeplugError(f"--rpc {', '.join(missing)}: the rpc-server offers no device")
    return devices
