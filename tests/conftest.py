"""Shared fixtures: a fresh home, synthetic models of every family, and real llama.cpp builds (shared
helpers that are not fixtures live in helpers.py).

The native builds go to the user's moeplug cache and data dirs (XDG), exactly where
`moeplug native build` puts them, so a second test run reuses them. Every test that uses a build
fixture (BUILD_FIXTURES, directly or through another fixture) carries the `native` marker, set here
at collection, so that `pytest -m "not native"` builds nothing; a test that needs a build some other
way (a command that builds) is marked in its file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import XDG, XdgHome, fixture_spec

from moeplug.model.synth import ARCHS, make_model


BUILD_FIXTURES = frozenset({"patched_build", "stock_build", "sanitized_build", "vulkan_build", "rpc_hosts", "rpc_devices"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The `native` marker on every test that uses a build fixture (before -m selects)."""
    for item in items:
        if BUILD_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("native") is None:
            item.add_marker(pytest.mark.native)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> XdgHome:
    """Fresh XDG data, state and config homes under tmp_path: set in this process (the library,
    helpers.run_cli) and carried by the returned environment (helpers.XdgHome, a dict) for the
    commands a test starts; the native builds shared through a link to the real builds folder, so a
    test that needs one asks for its fixture too."""
    h = XdgHome(tmp_path)
    for var in XDG:
        monkeypatch.setenv(var, h[var])
    return h


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
def vulkan_build():
    """The patched Vulkan build (`moeplug native build --vulkan`), run on Mesa's software Vulkan driver
    (lavapipe) without a GPU. What it needs from Debian (the Vulkan headers, glslc, the SPIR-V headers and
    lavapipe) is installed first where missing (a fresh CI machine runs as root), else named in one line."""
    from moeplug.core.paths import logs_dir
    from moeplug.native import build, resolve_options, vulkan

    logs_dir().mkdir(parents=True, exist_ok=True)
    needed = [package for _, package in vulkan.missing()]
    needed += [] if vulkan.has_lavapipe() else [vulkan.LAVAPIPE_PACKAGE]
    vulkan.install_packages(needed, logs_dir() / "vulkan-packages.log")
    return build(resolve_options("vulkan", stock=False, jobs=0, cuda_arch=None))


@pytest.fixture(scope="session")
def sanitized_build():
    """The patched CPU build under ASan and UBSan (`moeplug native build --sanitize`): llama-server
    and llama-moe-profile only, for the hostile-file tests."""
    from moeplug.native import build, resolve_options

    return build(resolve_options("cpu", stock=False, jobs=0, cuda_arch=None, sanitize=True))


@pytest.fixture
def rpc_hosts(patched_build):
    """Two rpc-servers of the patched build on loopback (CPU devices), as a user runs them on other
    machines: their endpoints, and the helpers.RpcServer of each (a test may end one); both ended
    afterwards."""
    from helpers import RpcServer

    servers = [RpcServer(patched_build).start() for _ in range(2)]
    try:
        yield [s.endpoint for s in servers], servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def rpc_devices(patched_build):
    """Two devices without a GPU: two rpc-servers of the patched build on loopback, backed by the CPU.
    Yields the environment and the llama.cpp flags that add the devices RPC0 and RPC1 (the build has
    llama.cpp's RPC backend compiled in)."""
    from helpers import RpcServer

    servers = [RpcServer(patched_build).start() for _ in range(2)]
    try:
        yield {"env": {}, "args": ["--rpc", ",".join(s.endpoint for s in servers)]}
    finally:
        for server in servers:
            server.stop()
