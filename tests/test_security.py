"""Security (issue 24, item 5): no shell strings in the code, servers on loopback unless --host
names another address (then with a warning), downloads hash-checked, hook files written only
where the command says.

The code check reads the syntax tree, so a comment or a string that mentions shell=True does not
count and an actual call does. The servers are real llama-servers: the test reads the address
they listen on from the kernel's socket table, not only the argument list.
"""

from __future__ import annotations

import ast
import json
import socket
from pathlib import Path

import pytest

import moeplug
from moeplug.serving import launch as serving
from moeplug.serving.server import HOST, start_server

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("plugin", "tui", "native/bench")

# calls that hand a string to /bin/sh
SHELL_FUNCTIONS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
                   ("asyncio", "create_subprocess_shell")}


def shell_uses(source: str, filename: str = "<code>") -> list[str]:
    """'file:line: what' for every shell use in the source: shell= with anything but a literal
    False, and the functions above however they were imported (module alias or from-import)."""
    tree = ast.parse(source, filename)
    modules: dict[str, str] = {}  # local name -> module, for `import os as o`
    functions: dict[str, tuple[str, str]] = {}  # local name -> (module, function), for `from os import system`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # `import os.path` binds os
                modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (node.module, alias.name) in SHELL_FUNCTIONS:
                    functions[alias.asname or alias.name] = (node.module, alias.name)
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{filename}:{node.lineno}: shell={ast.unparse(kw.value)}")
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            target = (modules.get(f.value.id, f.value.id), f.attr)
            if target in SHELL_FUNCTIONS:
                found.append(f"{filename}:{node.lineno}: {ast.unparse(f)}()")
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append(f"{filename}:{node.lineno}: {f.id}()")
    return found


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*.py"))


def test_the_check_sees_shell_calls_and_not_comments() -> None:
    bad = (
        "import os, subprocess as sp\n"
        "from os import popen as p\n"
        "os.system('ls')\n"
        "sp.run('ls', shell=True)\n"
        "sp.Popen(['ls'], shell=flag)\n"
        "p('ls')\n"
    )
    assert [u.split(": ", 1)[1] for u in shell_uses(bad)] == [
        "from os import popen", "os.system()", "shell=True", "shell=flag", "p()",
    ]
    good = (
        "import subprocess\n"
        "# never subprocess.run(cmd, shell=True) nor os.system(cmd)\n"
        "NOTE = 'os.popen and shell=True are not used'\n"
        "subprocess.run(['ls', '-l'], shell=False)\n"
        "subprocess.run(['ls'])\n"
    )
    assert shell_uses(good) == []


def test_no_shell_strings_in_the_code() -> None:
    files = code_files()
    names = {str(p.relative_to(REPO)) for p in files}
    assert {"plugin/serving/server.py", "plugin/serving/launch.py", "plugin/native/build.py", "native/bench/bench.py"} <= names
    assert Path(moeplug.__file__).resolve().parent == REPO / "plugin"  # the package under test is this checkout's
    found = [u for p in files for u in shell_uses(p.read_text(), str(p.relative_to(REPO)))]
    assert found == []


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as the kernel writes them) of the TCP sockets listening on port."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                out.add(addr)
    return out


LOOPBACK = socket.inet_aton("127.0.0.1")[::-1].hex().upper()  # /proc/net/tcp writes it little-endian: 0100007F


def _host_argument(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--host"]


@pytest.mark.native
def test_test_server_listens_on_loopback_only(tmp_path: Path, fixture_models, patched_build) -> None:
    with start_server(patched_build.binary("llama-server"), fixture_models["qwen3moe"], tmp_path / "s.log",
                      threads=2) as server:
        server.wait_healthy()
        assert _host_argument(server.args) == [HOST] == ["127.0.0.1"]
        assert _listening(server.port) == {LOOPBACK}


@pytest.mark.native
def test_served_model_listens_on_loopback_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_models,
                                               patched_build) -> None:
    """The detached server `moeplug install` and `moeplug serve` launch."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    record = serving.launch_verified("security-test", fixture_models["qwen3moe"], patched_build.binary("llama-server"),
                            patched_build.build_id, ["-t", "2", "-c", "512"], ctx=512)
    try:
        assert record.alive()
        assert _host_argument(record.args) == ["127.0.0.1"]
        assert _listening(record.port) == {LOOPBACK}
    finally:
        assert serving.stop("security-test") is True
    assert not record.alive()


def test_host_must_be_an_address(tmp_path: Path) -> None:
    from helpers import run_cli

    r = run_cli("serve", "demo", "--host", "example.com")
    assert r.returncode == 2 and "is not an IP address" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.native
def test_explicit_host_is_used_with_a_warning(tmp_path: Path, patched_build) -> None:
    """`moeplug install demo --host 0.0.0.0`: llama-server listens on every address, the command
    warns on stderr, and status and stop reach it (through the loopback)."""
    from helpers import XdgHome

    home = XdgHome(tmp_path)
    r = home.run("install", "demo", "--ctx", "1024", "--host", "0.0.0.0", "--json")
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "warning: llama-server listens on every address of this machine" in r.stderr
        srv = json.loads(r.stdout)["server"]
        assert _host_argument(srv["args"]) == ["0.0.0.0"] and srv["url"].startswith("http://127.0.0.1:")
        assert _listening(srv["port"]) == {"00000000"}
        (status,) = json.loads(home.run("status", "--json").stdout)["servers"]
        assert status["state"] == "healthy" and status["host"] == "0.0.0.0"
    finally:
        assert home.run("stop", "--all").returncode == 0
    r = home.run("serve", "demo", "--json")  # without --host: loopback again, no warning
    try:
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
        srv = json.loads(r.stdout)["server"]
        assert _host_argument(srv["args"]) == ["127.0.0.1"] and _listening(srv["port"]) == {LOOPBACK}
    finally:
        assert home.run("stop", "--all").returncode == 0


def test_downloads_are_hash_checked(tmp_path: Path) -> None:
    """A downloaded file whose SHA-256 is not the Hub's is deleted, blob and link, and named."""
    from moeplug.model.download import check_hash
    from moeplug.core.errors import MoeplugError
    from moeplug.core.fsutil import sha256_file

    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_bytes(b"GGUF and some weights")
    link = tmp_path / "snapshots" / "model.gguf"
    link.parent.mkdir()
    link.symlink_to(blob)
    good = sha256_file(blob)
    notes: list[object] = []
    check_hash(link, good.upper(), "some/repo/model.gguf", notes.append)  # the Hub's hex may be either case
    assert blob.exists() and len(notes) == 1
    with pytest.raises(MoeplugError, match=r"some/repo/model.gguf: SHA-256 .* is not the Hub's .*deleted"):
        check_hash(link, "0" * 64, "some/repo/model.gguf")
    assert not blob.exists() and not link.is_symlink()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and "builds" not in p.parts and "logs" not in p.parts}


@pytest.mark.native
def test_hook_files_are_written_only_where_given(tmp_path: Path, patched_build) -> None:
    """Every hook command, with HOME in the test's folder too: the only files that change are the
    ones named on the command line (and the first version's backup), moeplug's own state and the
    models' plan files in moeplug's profile store (which the written entries name)."""
    from helpers import XdgHome

    home = XdgHome(tmp_path)
    home.env["HOME"] = str(tmp_path / "home")
    assert home.run("install", "demo", "--no-serve", "--ctx", "1024").returncode == 0
    swap_file = tmp_path / "swap.yaml"
    swap_file.write_text("models:\n  mine:\n    cmd: llama-server --port ${PORT} -m mine.gguf\n")
    allowed = {"llama-swap/moeplug.yaml", "router.ini", "router.ini.moeplug-backup", "swap.yaml",
               "swap.yaml.moeplug-backup"}
    for argv in (("hook", "llama-swap", "--config-dir", str(home.swap_dir)),
                 ("hook", "llama-server", "--preset", str(home.preset)),
                 ("hook", "llama-swap", "--file", str(swap_file)),
                 ("hook", "list"),
                 ("hook", "remove", str(home.preset))):
        before = _tree(tmp_path)
        r = home.run(*argv)
        assert r.returncode == 0, (argv, r.stderr)
        after = _tree(tmp_path)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        state, plans = "xdg_state_home/moeplug/", "xdg_data_home/moeplug/profiles/"
        ours = {k for k in changed if k.startswith(plans) and k.endswith(".slots")}
        assert {k for k in changed if not k.startswith(state)} - ours <= allowed, (argv, changed)
        assert {k for k in changed if k.startswith(state)} <= {state + "hooks.json", state + "locks/hooks.lock"}
