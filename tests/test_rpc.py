"""Remote devices through llama.cpp's RPC backend (machine.rpc, planner/multi_gpu.py).

The planner on fixed machine facts (the Qwen3-30B-A3B shape, header only): a remote device comes
first in llama.cpp's order and holds whole layers, a partly resident layer goes there only where
the hop is modelled to pay, and stock's side runs over the same hosts. Then for real, two
rpc-servers of the patched build on loopback (CPU devices, as the `rpc_hosts` fixture starts
them): `moeplug install demo --rpc ...` plans over them and serves, the cache engages with slots on
both remote devices, and every token and probability is those of the same split without the
cache; hosts that do not answer, or are not rpc-servers, are one-line errors.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import moeplug, one_line_error, xdg_homes
from moeplug.commands.install import plan_text
from moeplug.core.errors import MoeplugError
from moeplug.core.sizes import GIB, MIB
from moeplug.machine.rpc import RemoteDevice, exposure, parse_rpc
from moeplug.model.inspect import inspect_model
from moeplug.planner.costs import DEFAULT_COSTS
from moeplug.planner.plan import make_plan
from moeplug.planner.request import MachineFacts, PlanRequest
from moeplug.planner.server_flags import stock_args
from moeplug.planner.speculation import Speculation
from moeplug.planner.split import layer_devices
from moeplug.profile.format import read_profile
from moeplug.serving.launch import parse_cache_line
from moeplug.serving.server import start_server
from test_golden_plans import MODELS, write_header_only, write_profile_for

HOST = "10.0.0.7:50052"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory):
    """The Qwen3-30B-A3B shape (48 MoE layers), header only, and a profile of it."""
    root = tmp_path_factory.mktemp("rpc-plans")
    spec, n_trunk = MODELS["qwen3"]
    model = write_header_only(spec, root / "qwen3.gguf")
    profile = write_profile_for(model, n_trunk, root / "qwen3.profile.gguf")
    return inspect_model(model), read_profile(profile), profile


def remote(free: int, name: str = "RPC0", endpoint: str = HOST) -> RemoteDevice:
    return RemoteDevice(name, endpoint, free + GIB, free)


def plan_of(qwen3, budget, devices, hop: float = DEFAULT_COSTS.rpc_hop_s, **asked):
    info, profile, path = qwen3
    request = PlanRequest(ctx=4096, vram_budget=budget, rpc=tuple(dict.fromkeys(d.endpoint for d in devices)), **asked)
    machine = MachineFacts(cpu_cores=8, costs=replace(DEFAULT_COSTS, rpc_hop_s=hop), remote=tuple(devices))
    return make_plan(info, request, machine, profile, path)


def test_a_remote_device_holds_whole_layers_before_this_machines_gpu(qwen3) -> None:
    info = qwen3[0]
    alone = plan_of(qwen3, 8 * GIB, [])
    plan = plan_of(qwen3, 8 * GIB, [remote(10 * GIB)])
    rpc0, cuda0 = plan.devices
    assert (rpc0.device, rpc0.endpoint, cuda0.device, cuda0.endpoint) == ("RPC0", HOST, "CUDA0", None)
    assert rpc0.blocks == list(range(len(rpc0.blocks))) and len(rpc0.blocks) >= 10 and not rpc0.output
    assert rpc0.whole_layers == rpc0.moe_layers and rpc0.slots == 0  # whole layers: stock's split there
    assert cuda0.output and cuda0.blocks == list(range(len(rpc0.blocks), info.n_layer))
    assert rpc0.used_bytes <= rpc0.budget_bytes and cuda0.used_bytes <= cuda0.budget_bytes
    args = plan.server_args
    assert args[args.index("--rpc") + 1] == HOST
    split = [int(x) for x in args[args.index("--tensor-split") + 1].split(",")]
    assert layer_devices(info.n_layer, split) == [0] * len(rpc0.blocks) + [1] * (info.n_layer + 1 - len(rpc0.blocks))
    # the layers the remote device holds whole are layers this machine's CPU no longer computes
    assert plan.modelled_host_ms < alone.modelled_host_ms
    assert plan.to_json()["devices"][0]["endpoint"] == HOST and "endpoint" not in plan.to_json()["devices"][1]
    text = plan_text(plan)  # the table says where each device is and which hop the plan paid
    assert f"RPC0    {HOST}" in text and "CUDA0   this machine" in text
    assert "hop to a remote device" in text and "1.00 ms there and back a step (a LAN's, not measured" in text


def test_a_remote_device_is_used_only_where_the_hop_pays(qwen3) -> None:
    """A small remote device (3 GiB: three of the shape's layers whole): behind a slow hop (5 ms
    there and back, twice what those layers save this CPU) it holds no layer and the plan says why;
    behind a LAN's it holds whole layers; with a hop of nothing the search may also give it layers
    partly resident, where that is modelled faster, their slots kept as profiled."""
    slow = plan_of(qwen3, 6 * GIB, [remote(3 * GIB)], hop=5e-3)
    assert slow.devices[0].blocks == [] and any("RPC0 (10.0.0.7:50052) holds no layer" in n for n in slow.notes)
    lan = plan_of(qwen3, 6 * GIB, [remote(3 * GIB)], hop=2e-4)
    assert lan.devices[0].whole_layers == lan.devices[0].moe_layers > 0 and lan.devices[0].slots == 0
    assert lan.modelled_host_ms < slow.modelled_host_ms
    free = plan_of(qwen3, 6 * GIB, [remote(3 * GIB)], hop=0.0)
    assert free.modelled_host_ms <= lan.modelled_host_ms
    if free.devices[0].slots:  # the dynamic policy's uploads would cross the network
        assert free.cache_policy == "static" and any("would cross the network" in n for n in free.notes)


def test_no_gpu_here_two_remote_devices_split_the_layers(qwen3) -> None:
    plan = plan_of(qwen3, None, [remote(7 * GIB), remote(7 * GIB, "RPC1", "10.0.0.8:50052")])
    assert plan.backend == "cpu" and plan.load_mode == "mmap"  # pinned memory is for a GPU of this machine
    assert [d.device for d in plan.devices] == ["RPC0", "RPC1"] and plan.devices[1].output
    assert "--rpc" in plan.server_args and "10.0.0.7:50052,10.0.0.8:50052" in plan.server_args
    assert sum(len(d.blocks) for d in plan.devices) == qwen3[0].n_layer


def test_stock_runs_over_the_same_hosts_at_the_same_budgets(qwen3) -> None:
    plan = plan_of(qwen3, 8 * GIB, [remote(10 * GIB)], rpc_budget=[6 * GIB])
    assert plan.devices[0].budget_bytes == 6 * GIB
    args = stock_args(plan, free=[9 * GIB])
    assert args[:2] == ["--rpc", HOST] and "--fit" in args
    # -fitt per device in llama.cpp's order: the remote one's free memory when planned less its budget, then this GPU's
    assert args[args.index("-fitt") + 1] == f"{4 * GIB // MIB},{1 * GIB // MIB}"


def test_what_the_planner_refuses_with_remote_devices(qwen3) -> None:
    with pytest.raises(MoeplugError, match="--rpc-budget: there is no --rpc host"):
        plan_of(qwen3, 8 * GIB, [], rpc_budget=[GIB])
    with pytest.raises(MoeplugError, match="--spec draft with --rpc"):
        plan_of(qwen3, 8 * GIB, [remote(10 * GIB)], spec=Speculation("draft", draft="x.gguf"))
    with pytest.raises(MoeplugError, match="remote devices are planned for llama.cpp's 512"):
        plan_of(qwen3, 8 * GIB, [remote(10 * GIB)], ubatch=1024)


def test_rpc_addresses_are_parsed_and_exposure_is_said() -> None:
    assert [h.endpoint for h in parse_rpc("192.168.1.5:50052,box,[::1]:6000")] == [
        "192.168.1.5:50052", "box:50052", "[::1]:6000"]
    for bad, why in (("a:1,,b:2", "empty entry"), ("h:70000", "out of range"), ("h:1,h:1", "given twice"),
                     ("h:x", "expected HOST:PORT")):
        with pytest.raises(MoeplugError, match=why):
            parse_rpc(bad)
    assert exposure("127.0.0.1") is None and exposure("192.168.1.5") is None and exposure("10.1.2.3") is None
    assert "no authentication" in exposure("8.8.8.8") and "every address" in exposure("0.0.0.0")


# --- for real: two rpc-servers on loopback -------------------------------------------------------

def cache_free(argv: list[str]) -> list[str]:
    """A served llama-server's flags beside its model, address and port, less the cache's (each
    --moe-cache-* with its value, where it takes one): the same split, stock."""
    args = argv[argv.index("-m") + 2:]
    out, i = [], 0
    while i < len(args):
        if args[i].startswith("--moe-cache") or args[i] in ("--host", "--port"):
            takes_value = i + 1 < len(args) and not args[i + 1].startswith("-")
            i += 2 if takes_value else 1
            continue
        out.append(args[i])
        i += 1
    return out


def answers(url_or_server) -> list:
    prompts = [list(range(100 + 29 * i, 130 + 29 * i)) for i in range(3)]
    return [(r["tokens"], r["completion_probabilities"]) for r in
            (url_or_server.complete(p, n_predict=48, ignore_eos=True, n_probs=1) for p in prompts)]


@pytest.mark.native
def test_serve_demo_over_two_rpc_servers_engages_the_cache_bitwise(patched_build, rpc_hosts, tmp_path: Path) -> None:
    """The demo planned for a machine whose CPU is slow beside the hop (a calibration file), with
    848 MiB on each remote device: slots on RPC0 and RPC1, the experts in this machine's RAM. Served,
    the log says the cache engaged on both devices, and greedy answers with their probabilities are
    those of the same split without the cache, bit for bit (CPU kernels everywhere)."""
    endpoints, _ = rpc_hosts
    home = xdg_homes(tmp_path)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"cpu_expert_bytes_per_s": 1e8, "rpc_hop_s": 2e-5}))
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--rpc", ",".join(endpoints), "--rpc-budget",
                "848MiB,848MiB", "--calibration", str(cal), "--no-check", "--no-serve", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)["plan"]
    assert [(d["device"], d["endpoint"]) for d in plan["devices"]] == [("RPC0", endpoints[0]), ("RPC1", endpoints[1])]
    assert all(d["slots"] > 0 for d in plan["devices"]) and plan["cache_policy"] == "static"
    assert "--rpc" in plan["server_args"] and "--moe-cache-slots" in plan["server_args"]
    served = moeplug(home, "serve", "demo", "--json")
    assert served.returncode == 0, served.stderr[-3000:]
    server = json.loads(served.stdout)["server"]
    try:
        from moeplug.serving import client

        url = server["url"]
        mine = [(x["tokens"], x["completion_probabilities"]) for x in
                (client.complete(url, list(range(100 + 29 * i, 130 + 29 * i)), 48, ignore_eos=True, n_probs=1)
                 for i in range(3))]
        cache = parse_cache_line(Path(server["log"]).read_text())
        assert cache is not None and cache.engaged and cache.device == "RPC0, RPC1", cache
        assert server["cache"]["engaged"] and server["cache"]["device"] == "RPC0, RPC1"
    finally:
        assert moeplug(home, "stop", "demo").returncode == 0
    # the same split without the cache (an rpc-server serves one client at a time: after the first)
    args = cache_free(server["args"])
    assert "--rpc" in args and "--moe-cache-slots" not in args
    with start_server(patched_build.binary("llama-server"), Path(plan["model"]), tmp_path / "split.log",
                      extra_args=args, ctx=None) as srv:
        srv.wait_healthy(timeout=180)
        assert answers(srv) == mine


@pytest.mark.native
def test_hosts_that_are_not_rpc_servers_are_one_line_errors(patched_build, tmp_path: Path) -> None:
    home = xdg_homes(tmp_path)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    r = moeplug(home, "install", "demo", "--rpc", f"127.0.0.1:{closed}", "--no-serve", "--no-check")
    one_line_error(r, None, f"127.0.0.1:{closed}", "does not answer")
    installed = Path(home["XDG_DATA_HOME"]) / "moeplug" / "installed" / "demo.json"
    assert not installed.exists()
    # a port that accepts and says nothing an rpc-server would
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def close_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    try:
        r = moeplug(home, "plan", "demo", "--rpc", f"127.0.0.1:{port}")
        last = r.stderr.strip().splitlines()[-1]  # after the progress lines (the demo model made, the hosts asked)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert last.startswith("moeplug: error: --rpc 127.0.0.1:") and "not an rpc-server" in last, last
    finally:
        listener.close()
    one_line_error(moeplug(home, "plan", "demo", "--rpc", "127.0.0.1:99999"), 2, "--rpc", "out of range")
    one_line_error(moeplug(home, "plan", "demo", "--rpc-budget", "1GiB"), None, "no --rpc host")
    assert not installed.exists()


@pytest.mark.native
def test_serving_with_a_host_gone_names_the_host(patched_build, rpc_hosts, tmp_path: Path) -> None:
    """Installed over a host that has since ended: `serve` says which host does not answer, in one
    line, before llama.cpp would abort on it; and a server that still ends while loading names
    llama.cpp's abort message, not a debugger's backtrace."""
    endpoints, servers = rpc_hosts
    home = xdg_homes(tmp_path)
    r = moeplug(home, "install", "demo", "--ctx", "1024", "--rpc", endpoints[0], "--no-check", "--no-serve")
    assert r.returncode == 0, r.stderr[-3000:]
    servers[0].kill()
    one_line_error(moeplug(home, "serve", "demo"), 1, endpoints[0], "does not answer")
    from moeplug.serving.server import start_server

    with pytest.raises(MoeplugError) as err:  # past the check: llama.cpp itself meets the host gone
        with start_server(patched_build.binary("llama-server"), Path(home["XDG_DATA_HOME"]) / "moeplug" / "models" /
                          "demo-qwen3moe-q8_0.gguf", tmp_path / "gone.log", ["--rpc", endpoints[0], "-ngl", "99"]) as srv:
            srv.wait_healthy(timeout=120)
    assert "Failed to connect to" in str(err.value) and "#" not in str(err.value).split("(log:")[0], err.value
