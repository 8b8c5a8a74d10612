"""Why a served model is not serving, in one line, found without waiting long and without taking a
remote device from the server that holds it (moeplug.serving.monitor puts it in `status`).

A server with remote devices (llama.cpp's RPC backend, machine.rpc) meets a host that drops in
one of three ways, each seen on llama.cpp b11434 with two local rpc-servers (tests/test_rpc_serving.py):

- the rpc-server ends (killed, crashed, its machine rebooted) while the server is idle: nothing
  shows until a request needs it; the server's connection to it is closed by the peer (TCP
  CLOSE_WAIT), which `closed_by_peer` reads from /proc without sending anything anywhere. llama.cpp
  does not connect again: the next request ends the server (below).
- a request needs a host that has ended: ggml-rpc's RPC_STATUS_ASSERT aborts the server ("Remote
  RPC server crashed or returned malformed response", ggml-rpc.cpp); the request's connection
  drops, and the server is down. `last_error_line` names why from its log (llama.cpp's abort
  message, before the backtrace it prints), and `hosts_not_answering` which hosts no longer take
  a connection: asked only once the server is gone, for the hosts no other served model holds (an
  rpc-server serves one client at a time, and a connection to a held one waits for it).
- a host that stops answering without closing its connection hangs the server at the next request
  (seen with a stopped rpc-server, SIGSTOP; a host cut off by the network closes nothing either,
  not tried): /health still answers ok (llama-server answers it outside its work loop), but the
  work loop, waiting on the host, answers nothing else. `work_loop_waits` asks /slots, which the
  work loop answers, and reads the process's CPU time meanwhile: no answer and no CPU time is a
  loop that waits, not one busy with a long batch on this machine (a long batch on a remote device
  looks the same while it runs).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moeplug.machine.rpc import no_answer, parse_rpc
from moeplug.serving import client

TAIL_BYTES = 256 * 1024  # an abort's message and the backtrace after it fit in far less
PROBE_TIMEOUT_S = 1.0  # a host that takes no connection in this long counts as not answering
WAIT_CPU_SHARE = 0.2  # less CPU than this share of one core while /slots went unanswered: the loop waits

# llama.cpp's ggml_abort ("FILE:LINE: MESSAGE", GGML_ABORT and GGML_ASSERT alike), a C++ exception's
# message as std::terminate prints it, a log line at llama.cpp's error level ("TIME E MESSAGE"), and,
# last, any other line that says error or failed (not a debugger's backtrace line, "#N ...")
_ABORT = re.compile(r"^(?P<file>\S+\.(?:c|cc|cpp|cu|h|hpp|m|mm)):(?P<line>\d+): (?P<msg>\S.*)$")
_WHAT = re.compile(r"^\s*what\(\):\s+(?P<msg>\S.*)$")
_LEVEL_E = re.compile(r"^(?:\d+(?:\.\d+)+ )?E (?P<msg>\S.*)$")
_ERRORISH = re.compile(r"\b(?:error|failed|fatal)\b", re.I)


def last_error_line(log: str | Path) -> str | None:
    """The line of a server's log that says why it ended: llama.cpp's abort message (with its
    source file and line), else a C++ exception's, else the last error-level line, else the last
    line that says error or failed; None where the log says none (killed from outside)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    lines = [ln.strip() for ln in lines if ln.strip()]
    for ln in reversed(lines):
        m = _ABORT.match(ln)
        if m:
            return f"{m['msg'].strip()} ({Path(m['file']).name}:{m['line']})"
    for pattern in (_WHAT, _LEVEL_E):
        for ln in reversed(lines):
            m = pattern.match(ln)
            if m:
                return m["msg"].strip()
    return next((ln for ln in reversed(lines) if _ERRORISH.search(ln) and not ln.startswith("#")), None)


def hosts_not_answering(endpoints: list[str], timeout: float = PROBE_TIMEOUT_S) -> dict[str, str]:
    """Of these rpc-servers (HOST:PORT), the ones that take no connection now, each with why (a
    connection opened and closed at once, as `moeplug plan --rpc` checks a host; all at once, so
    the whole check takes about `timeout` at most). Never ask a host a running server holds."""
    def why(endpoint: str) -> str | None:
        return no_answer(parse_rpc(endpoint)[0], timeout)

    if not endpoints:
        return {}
    with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        found = dict(zip(endpoints, pool.map(why, endpoints)))
    return {e: w for e, w in found.items() if w}


def _addresses(endpoint: str) -> set[tuple[str, int]]:
    """(IP address, port) an endpoint names; a host name resolved (an IPv4 address also as the
    IPv4-mapped IPv6 one, as a dual-stack socket shows it)."""
    host = parse_rpc(endpoint)[0]
    try:
        ips = {a[4][0].split("%")[0] for a in socket.getaddrinfo(host.host, host.port, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()
    return {(ip, host.port) for ip in ips} | {(f"::ffff:{ip}", host.port) for ip in ips if ":" not in ip}


def _remote(hex_address: str) -> tuple[str, int]:
    """/proc/net/tcp's 'HEXIP:HEXPORT' (the IP as 32-bit words in the machine's byte order) as (IP, port)."""
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    words = raw if sys.byteorder == "big" else b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words), int(port_hex, 16)


CLOSE_WAIT = "08"  # the peer closed the connection; this end has not yet


def closed_by_peer(pid: int, endpoints: list[str]) -> list[str]:
    """Of these rpc-servers, the ones whose connection from the process `pid` the server's side has
    closed (the kernel's socket table, read from /proc: nothing is sent). Empty where /proc cannot
    say (another user's process, not Linux)."""
    if not endpoints:
        return []
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    closed: set[tuple[str, int]] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == CLOSE_WAIT and cols[9] in inodes:
                closed.add(_remote(cols[2]))
    return [e for e in endpoints if _addresses(e) & closed] if closed else []


def cpu_seconds(pid: int) -> float | None:
    """The CPU time the process has used (user and system), or None where /proc does not say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def work_loop_waits(url: str, pid: int, timeout: float) -> tuple[bool, list[dict] | None]:
    """Whether the server's work loop waits on something: /slots (which the work loop answers)
    unanswered in `timeout` while the process used less than WAIT_CPU_SHARE of a core; and /slots'
    answer where it came."""
    before, start = cpu_seconds(pid), time.monotonic()
    try:
        found = client.slots(url, timeout=timeout, timeouts=True)
    except TimeoutError:
        after, wall = cpu_seconds(pid), time.monotonic() - start
        busy = before is None or after is None or after - before >= WAIT_CPU_SHARE * wall
        return not busy, None
    return False, found
