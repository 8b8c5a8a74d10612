"""Shared fixtures: synthetic models of every family, and real llama.cpp builds (shared helpers
that are not fixtures live in helpers.py).

The native builds go to the user's moeplug cache and data dirs (XDG), exactly where
`moeplug native build` puts them, so a second test run reuses them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import fixture_spec

from moeplug.model.synth import ARCHS, make_model


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One Q8_0 model per architecture family, and hy_v3 with an MTP (NextN) block."""
    from dataclasses import replace

    root = tmp_path_factory.mktemp("models")
    models = {arch: make_model(fixture_spec(arch), root / f"{arch}.gguf")[0] for arch in ARCHS}
    models["hy_v3-mtp"] = make_model(replace(fixture_spec("hy_v3"), mtp_layers=1), root / "hy_v3-mtp.gguf")[0]
    return models


@pytest.fixture(scope="session")
def patched_build():
    from moeplug.native import build, resolve_options

    return build(resolve_options("cpu", stock=False, jobs=0, cuda_arch=None))


@pytest.fixture(scope="session")
def stock_build():
    from moeplug.native import build, resolve_options

    return build(resolve_options("cpu", stock=True, jobs=0, cuda_arch=None))


@pytest.fixture(scope="session")
def sanitized_build():
    """The patched CPU build under ASan and UBSan (`moeplug native build --sanitize`): llama-server
    and llama-moe-profile only, for the hostile-file tests."""
    from moeplug.native import build, resolve_options

    return build(resolve_options("cpu", stock=False, jobs=0, cuda_arch=None, sanitize=True))


def start_rpc_servers(build, n: int, threads: int = 1) -> tuple[list[str], list]:
    """n of the build's ggml-rpc-server on free loopback ports, each listening: their endpoints and
    processes (the caller ends them)."""
    import socket
    import subprocess
    import time

    endpoints, procs = [], []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen([str(build.binary("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port),
                                       "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and procs[-1].poll() is None, "ggml-rpc-server did not listen"
                time.sleep(0.1)
        endpoints.append(f"127.0.0.1:{port}")
    return endpoints, procs


@pytest.fixture
def rpc_hosts(patched_build):
    """Two rpc-servers of the patched build on loopback (CPU devices), as a user runs them on other
    machines: their endpoints, and the processes (a test may end one); both ended afterwards."""
    endpoints, procs = start_rpc_servers(patched_build, 2)
    try:
        yield endpoints, procs
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def rpc_devices(patched_build, tmp_path_factory: pytest.TempPathFactory):
    """Two devices without a GPU: two local rpc-server processes backed by the CPU, and llama.cpp's
    RPC backend library, both compiled from the patched build's own source tree against its libggml
    (a few seconds with g++). Yields the environment and the llama.cpp flags that add the devices
    RPC0 and RPC1: an -ot before --rpc, because llama.cpp loads the dynamic backends only while none
    but the built-in CPU one is registered (common/arg.cpp)."""
    import shutil
    import socket
    import subprocess
    import time

    from moeplug.native.build import tree_id
    from moeplug.native.lock import load_spec
    from moeplug.native.source import prepare_tree

    out = tmp_path_factory.mktemp("rpc")
    spec = load_spec()
    tree = prepare_tree(spec, False, tree_id(spec, False), out / "tree.log")
    lib = patched_build.bin_dir
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler (the native build has one)"
    inc = [f"-I{tree / 'ggml' / 'include'}", f"-I{tree / 'ggml' / 'src'}"]
    link = [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    rpc = tree / "ggml" / "src" / "ggml-rpc"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-DGGML_BACKEND_DL", "-DGGML_BACKEND_SHARED",
                    "-DGGML_BACKEND_BUILD", "-DGGML_SHARED", "-DGGML_BUILD", *inc, str(rpc / "ggml-rpc.cpp"),
                    str(rpc / "transport.cpp"), *link, "-lggml-base", "-o", str(out / "libggml-rpc.so")], check=True)
    subprocess.run([cxx, "-std=c++17", "-O1", *inc, str(tree / "tools" / "rpc" / "rpc-server.cpp"), *link, "-lggml",
                    "-lggml-base", "-o", str(out / "rpc-server")], check=True)

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([str(out / "rpc-server"), "-p", str(p)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for p in ports]
    try:
        for p in ports:
            deadline = time.time() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", p), timeout=1).close()
                    break
                except OSError:
                    assert time.time() < deadline, "rpc-server did not listen"
                    time.sleep(0.1)
        yield {"env": {"GGML_BACKEND_PATH": str(out / "libggml-rpc.so")},
               "args": ["-ot", "no-such-tensor=CPU", "--rpc", ",".join(f"127.0.0.1:{p}" for p in ports)]}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
