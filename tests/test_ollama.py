"""`moeplug hook ollama` and `--moe-cache-profile DIR` / `--moe-cache-slots auto`, on the CPU build.

No Ollama can be installed here, so its side is laid out from its source (ollama/ollama): an
install tree `bin/ollama` + `lib/ollama/` whose llama-server is the stock build (its shared
libraries beside it), a model store (`manifests/registry.ollama.ai/library/NAME/TAG` -> blob
`sha256-HEX`), and llama-server started with the argv and environment `llm/llama_server.go`
gives it (startLlamaServer, SetupLlamaServerCommandEnv). `bin/ollama` is a text file naming the
flags and variables that program passes, as the real executable holds them as string literals.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests
from helpers import moeplug, one_line_error, use_xdg_homes

from moeplug.serving.client import complete
from moeplug.serving.server import free_port

pytestmark = pytest.mark.native

# startLlamaServer's flags (llm/llama_server.go) and the variables SetupLlamaServerCommandEnv sets
OLLAMA_PROGRAM = ("--model --port --host --no-webui --offline -c -np --log-verbosity --no-log-prefix "
                  "--no-log-timestamps --flash-attn --cache-type-k --cache-type-v -ngl -t -b -ub --load-mode "
                  "LLAMA_ARG_FIT_TARGET LLAMA_MEDIA_MARKER GGML_BACKEND_PATH")
PROMPT = "def fib(n):\n    return"


def tree_digest(folder: Path) -> dict[str, str]:
    """Every entry of a folder: file bytes and mode, or link target."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_symlink():
            out[p.name] = "link:" + os.readlink(p)
        else:
            out[p.name] = f"{oct(p.stat().st_mode & 0o7777)}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
    return out


def copy_server(bin_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for p in bin_dir.iterdir():
        if p.name == "llama-server" or ".so" in p.name:
            if p.is_symlink():
                os.symlink(os.readlink(p), dest / p.name)
            else:
                shutil.copy2(p, dest / p.name)


def add_to_store(models: Path, name: str, blob_src: Path) -> Path:
    data = blob_src.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)}]}))
    return blob


@pytest.fixture(scope="module")
def ollama(stock_build, patched_build, tmp_path_factory: pytest.TempPathFactory):
    """XDG homes, a fake Ollama install with the stock llama-server, two models in its store."""
    from moeplug.model.synth import ModelSpec, make_model

    root = tmp_path_factory.mktemp("ollama")
    with pytest.MonkeyPatch.context() as mp:
        use_xdg_homes(mp, root)
        mp.setenv("OLLAMA_MODELS", str(root / "models"))
        mp.setenv("MOEPLUG_SYSTEMD_DIR", str(root / "systemd"))  # no ollama.service: shell lines
        prefix = root / "ollama"
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "ollama").write_text(f"#!/bin/sh\n# {OLLAMA_PROGRAM}\n")
        (prefix / "bin" / "ollama").chmod(0o755)
        copy_server(stock_build.bin_dir, prefix / "lib" / "ollama")
        blobs = {}
        for name, seed in (("alpha", 99), ("beta", 5)):
            src = make_model(ModelSpec(arch="qwen3moe", layers=4, experts=32, used=4, embd=256, expert_ff=256,
                                       dtype="q8_0", seed=seed, name=name), root / f"{name}.gguf")[0]
            blobs[name] = add_to_store(root / "models", name, src)
        yield {"root": root, "prefix": prefix, "lib": prefix / "lib" / "ollama", "blobs": blobs,
               "stock": tree_digest(prefix / "lib" / "ollama")}


def start_as_ollama(binary: Path, blob: Path, log: Path, env_extra: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """llama-server as startLlamaServer runs it: its argv, Ollama's environment plus LD_LIBRARY_PATH
    (the binary's folder first) and LLAMA_MEDIA_MARKER."""
    port = free_port()
    argv = [str(binary), "--model", str(blob), "--port", str(port), "--host", "127.0.0.1", "--no-webui", "--offline",
            "-c", "1024", "-np", "1", "--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps",
            "--flash-attn", "auto"]
    env = dict(os.environ, **env_extra)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))
    env["LLAMA_MEDIA_MARKER"] = "<__ollama_media_0__>"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(log.read_text()[-3000:])


def answer(binary: Path, blob: Path, log: Path, env: dict[str, str]) -> tuple[list[int], str]:
    proc, url = start_as_ollama(binary, blob, log, env)
    try:
        tokens = complete(url, PROMPT, n_predict=12)["tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return tokens, log.read_text()


def cache_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith(("moe-cache:", "moe-settings:"))]


def test_hook_swaps_in_every_model_finds_its_profile_and_remove_restores(ollama, tmp_path: Path) -> None:
    lib, prefix = ollama["lib"], ollama["prefix"]
    stock_answers = {n: answer(lib / "llama-server", b, tmp_path / f"stock-{n}.log", {})[0]
                     for n, b in ollama["blobs"].items()}

    r = moeplug(None, "hook", "ollama", "--ollama-dir", str(prefix), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["environment"]["LLAMA_ARG_MOE_CACHE_SLOTS"] == "auto" and "export LLAMA_ARG_MOE_CACHE_PROFILE=" in doc["next"]
    # one environment, the same for every model: each model's choices are in its own slots file, not here
    assert sorted(doc["environment"]) == ["LLAMA_ARG_MOE_CACHE_PROFILE", "LLAMA_ARG_MOE_CACHE_SLOTS"]
    assert tree_digest(lib) != ollama["stock"]
    assert "moe_cache_profile" in subprocess.run([str(lib / "llama-server"), "--help"], capture_output=True,
                                                 text=True).stdout.replace("-", "_")

    # alpha installed from Ollama's store (its blob in place) with a budget that holds part of its experts
    r = moeplug(None, "plan", "ollama:alpha", "--vram-budget", "8GiB", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    fixed = p["non_expert_vram_bytes"] + p["kv_cache_bytes"] + p["compute_bytes"] + p["margin_bytes"]
    budget = fixed + 12 * p["bytes_per_slot"]
    r = moeplug(None, "install", "ollama:alpha", "--vram-budget", str(budget), "--no-serve", "--ctx", "1024",
                "--profile-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    inst = json.loads(r.stdout)
    assert inst["model"] == str(ollama["blobs"]["alpha"])
    slots = inst["plan"]["slots_per_layer"]
    assert 0 < sum(slots) < 32 * 4, slots
    sidecar = Path(inst["profile"]).with_suffix(".slots")
    assert f"slots = {slots[0] if len(set(slots)) == 1 else ','.join(map(str, slots))}" in sidecar.read_text()

    # every variable the hook sets, read by its server; and, this machine having no GPU, the engine's debugging
    # switch that holds a GPU plan's slots in RAM (the same for every model)
    env = {**doc["environment"], "LLAMA_MOE_CACHE_DEVICE": "CPU"}
    tokens, log = answer(lib / "llama-server", ollama["blobs"]["alpha"], tmp_path / "alpha.log", env)
    lines = cache_lines(log)
    used = [n for n in slots if n]
    span = f"{max(used)}" if len(set(used)) == 1 else f"{min(used)}-{max(used)}"
    assert any(f"from {sidecar}" in ln for ln in lines), lines
    assert any(ln.startswith(f"moe-cache: {len(used)} layers x {span} slots") for ln in lines), lines
    assert tokens == stock_answers["alpha"]  # bitwise stock on the CPU
    # the engine took alpha's own plan from the file: every setting of its flags, as its flags say it
    flags = dict(zip(inst["plan"]["server_args"], inst["plan"]["server_args"][1:]))
    [settings] = [dict(kv.split("=", 1) for kv in ln.split()[1:]) for ln in lines if ln.startswith("moe-settings:")]
    for key in ("policy", "max-batch", "half-life", "uploads", "offload-min-batch", "device", "copy-ahead"):
        if f"--moe-cache-{key}" in flags:
            assert settings[key] == flags[f"--moe-cache-{key}"], (key, settings, flags)
    assert settings["placement"] == "moeplug" and settings["plan"] == str(sidecar)

    # its check chose stock's placement (the record as the check writes it): the hook's refresh writes
    # placement = stock, and the same environment runs alpha without slots
    from moeplug.serving.installed import Verdict, read_installed, write_installed
    from dataclasses import replace as replaced
    import time as clock
    record = read_installed(inst["name"])  # the module's homes are this process's environment
    write_installed(replaced(record, verdict=Verdict(placement="stock", decode=0.6, prefill=0.9, decode_lowest=0.5,
                                                      prompts=4, budget_bytes=budget, checked_at=clock.time(),
                                                      chosen="stock")))
    r = moeplug(None, "hook", "ollama", "--ollama-dir", str(prefix), "--json")
    assert r.returncode == 0, r.stderr
    assert "placement = stock" in sidecar.read_text() and "slots =" not in sidecar.read_text()
    tokens, log = answer(lib / "llama-server", ollama["blobs"]["alpha"], tmp_path / "alpha-stock.log", env)
    lines = cache_lines(log)
    assert any(ln.startswith("moe-settings: placement=stock") for ln in lines), lines
    assert not any(re.match(r"moe-cache: \d+ layers x", ln) for ln in lines), lines
    assert tokens == stock_answers["alpha"]

    tokens, log = answer(lib / "llama-server", ollama["blobs"]["beta"], tmp_path / "beta.log", env)
    assert cache_lines(log) == [f"moe-cache: not engaged, running without it: no profile for this model in "
                                f"{env['LLAMA_ARG_MOE_CACHE_PROFILE']}"]
    assert tokens == stock_answers["beta"]

    r = moeplug(None, "hook", "list", "--json")
    assert [h["state"] for h in json.loads(r.stdout)["hooks"]] == ["ok"]

    r = moeplug(None, "hook", "remove", "ollama")
    assert r.returncode == 0, r.stderr
    assert tree_digest(lib) == ollama["stock"]  # byte for byte, modes and links
    assert moeplug(None, "hook", "list", "--json").stdout.count('"target"') == 0


def test_an_ollama_update_shows_in_hook_list_and_the_watcher_swaps_again(ollama, stock_build) -> None:
    from moeplug.hooks import ollama as hook
    from moeplug.operations.watch import watch_store

    lib = ollama["lib"]
    units = Path(os.environ["MOEPLUG_SYSTEMD_DIR"])
    units.mkdir(parents=True, exist_ok=True)
    (units / "ollama.service").write_text("[Service]\nExecStart=/usr/local/bin/ollama serve\n")
    r = moeplug(None, "hook", "ollama", "--ollama-dir", str(lib))
    assert r.returncode == 0, r.stderr
    dropin = units / "ollama.service.d" / "moeplug.conf"
    assert f"wrote {dropin}" in r.stdout
    assert "Environment=LLAMA_ARG_MOE_CACHE_SLOTS=auto\n" in dropin.read_text()
    update = ollama["root"] / "update"

    def ollama_update(data_from: Path) -> None:  # Ollama's updater puts another llama-server in place
        shutil.copy2(data_from, update)
        os.replace(update, lib / "llama-server")

    ollama_update(ollama["prefix"] / "bin" / "ollama")
    assert "an Ollama update" in json.loads(moeplug(None, "hook", "list", "--json").stdout)["hooks"][0]["state"]

    notes: list[str] = []
    watcher = watch_store(debounce=0.2, progress=lambda e: notes.append(str(e)))
    try:
        ollama_update(ollama["prefix"] / "bin" / "ollama")  # not a llama-server: the watcher warns
        deadline = time.time() + 30
        while time.time() < deadline and not any("not a llama-server" in n for n in notes):
            time.sleep(0.2)
        assert any("not a llama-server" in n for n in notes), notes
        assert hook.binary_state(lib) == "replaced"
        ollama_update(stock_build.binary("llama-server"))  # a real one: checked and swapped again
        deadline = time.time() + 60
        while time.time() < deadline and hook.binary_state(lib) != "swapped":
            time.sleep(0.2)
        assert hook.binary_state(lib) == "swapped", notes
    finally:
        watcher.stop()
    assert json.loads(moeplug(None, "hook", "list", "--json").stdout)["hooks"][0]["state"] == "ok"
    assert moeplug(None, "hook", "remove", "ollama").returncode == 0
    assert tree_digest(lib) == ollama["stock"]  # the update's binary (here: stock's) back, the rest as first kept
    assert not dropin.exists()
    (units / "ollama.service").unlink()


def test_refusals_change_nothing(ollama, tmp_path: Path) -> None:
    # a bundled llama-server that takes a flag this Ollama passes and moeplug's does not
    prefix = tmp_path / "newer"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "ollama").write_text(f"# {OLLAMA_PROGRAM} --reasoning-budget-next\n")
    copy_server(ollama["lib"], prefix / "lib" / "ollama")
    server = prefix / "lib" / "ollama" / "llama-server"
    os.replace(server, server.with_name("llama-server.real"))
    server.write_text('#!/bin/sh\nif [ "$1" = --help ]; then "$0.real" --help; '
                      'echo "--reasoning-budget-next N   a flag of a newer llama.cpp"; else exec "$0.real" "$@"; fi\n')
    server.chmod(0o755)
    before = tree_digest(server.parent)
    one_line_error(moeplug(None, "hook", "ollama", "--ollama-dir", str(prefix)), 1, "--reasoning-budget-next",
                   "nothing changed")
    assert tree_digest(server.parent) == before
    assert json.loads(moeplug(None, "hook", "list", "--json").stdout)["hooks"] == []

    # an install folder moeplug cannot write (immutable: root writes anywhere else)
    lib = ollama["lib"]
    if subprocess.run(["chattr", "+i", str(lib)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on this file system")
    try:
        one_line_error(moeplug(None, "hook", "ollama", "--ollama-dir", str(lib)), 1, f"cannot write {lib}", "nothing changed")
    finally:
        subprocess.run(["chattr", "-i", str(lib)], check=True)
    assert tree_digest(lib) == ollama["stock"]
    assert json.loads(moeplug(None, "hook", "list", "--json").stdout)["hooks"] == []


def test_profile_dir_no_match_two_matches_corrupt_slots_auto(ollama, patched_build, tmp_path: Path) -> None:
    """--moe-cache-profile DIR straight on the patched llama-server: one line each, the model serves."""
    from moeplug.operations.install import ensure_profile

    binary = patched_build.binary("llama-server")
    alpha = ollama["blobs"]["alpha"]
    profile = ensure_profile(alpha, patched_build.binary("llama-moe-profile"), 16, ["codeish"])
    stock_tokens = answer(binary, alpha, tmp_path / "stock.log", {})[0]

    def run(folder: Path, slots: str | None = "auto") -> list[str]:
        env = {"LLAMA_ARG_MOE_CACHE_PROFILE": str(folder), "LLAMA_MOE_CACHE_DEVICE": "CPU"}
        if slots is not None:
            env["LLAMA_ARG_MOE_CACHE_SLOTS"] = slots
        tokens, log = answer(binary, alpha, tmp_path / f"{folder.name}.log", env)
        assert tokens == stock_tokens
        return cache_lines(log)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.gguf").write_text("not a GGUF")
    assert run(empty) == [f"moe-cache: not engaged, running without it: no profile for this model in {empty}"]

    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(profile, two / "a.gguf")
    shutil.copy(profile, two / "b.gguf")
    assert run(two) == [f"moe-cache: not engaged, running without it: 2 profiles for this model in {two} "
                        f"(a.gguf, b.gguf): keep one"]

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    shutil.copy(profile, corrupt / "p.gguf")
    (corrupt / "p.slots").write_text("version = 1\nslots 8\n")
    assert run(corrupt) == [f"moe-cache: not engaged, running without it: the slots file {corrupt / 'p.slots'} is "
                            f"corrupt: line 2 is not KEY = VALUE"]

    (corrupt / "p.slots").unlink()  # no slots file: auto, on the CPU device a quarter of the experts
    lines = run(corrupt, slots=None)
    assert len(lines) == 3 and "slots 8 from auto" in lines[0], lines
    assert lines[1].startswith("moe-settings: placement=moeplug slots=8 ") and lines[1].endswith(" plan=none"), lines
    assert lines[2].startswith("moe-cache: 4 layers x 8 slots"), lines

    # a version 2 file: a setting no flag would take is refused, naming the key, and the model runs without the cache
    from moeplug.profile.format import model_fingerprint
    fp = model_fingerprint(alpha)
    (corrupt / "p.slots").write_text(f"version = 2\nmodel.meta_hash = {fp.meta_hash}\nmodel.size = {fp.size}\n"
                                     f"slots = 8\npolicy = sometimes\n")
    assert run(corrupt) == [f"moe-cache: not engaged, running without it: the slots file {corrupt / 'p.slots'} is "
                            f"corrupt: policy = sometimes is not a value --moe-cache-policy takes"]
    # ... and a good one sets what no flag gave: the flag given (LLAMA_ARG_*) wins over the file
    (corrupt / "p.slots").write_text(f"version = 2\nmodel.meta_hash = {fp.meta_hash}\nmodel.size = {fp.size}\n"
                                     f"slots = 6\npolicy = dynamic\nuploads = 3\nmax-batch = 64\ncopy-ahead = off\n")
    env = {"LLAMA_ARG_MOE_CACHE_PROFILE": str(corrupt), "LLAMA_ARG_MOE_CACHE_SLOTS": "auto",
           "LLAMA_ARG_MOE_CACHE_DEVICE": "CPU", "LLAMA_ARG_MOE_CACHE_MAX_BATCH": "32"}
    tokens, log = answer(binary, alpha, tmp_path / "v2.log", env)
    assert tokens == stock_tokens
    [line] = [ln for ln in cache_lines(log) if ln.startswith("moe-settings:")]
    assert ("placement=moeplug slots=6 max-batch=32 margin=1024 policy=dynamic half-life=128 uploads=3 stream=0 "
            "offload-min-batch=0 copy-ahead=off device=CPU plan=" + str(corrupt / "p.slots")) in line, line


def test_the_environment_carries_the_plans_remote_devices(ollama, patched_build, tmp_path: Path) -> None:
    """A model installed with --rpc: Ollama's environment gets llama.cpp's LLAMA_ARG_RPC with its hosts
    (and one model loaded at a time: an rpc-server serves one client), and a llama-server started as
    Ollama starts it runs on them; the drop-in follows a re-plan without them; plans that name
    different hosts leave it out (one environment for every model), and the hook says why."""
    from helpers import RpcServer

    lib, prefix = ollama["lib"], ollama["prefix"]
    units = Path(os.environ["MOEPLUG_SYSTEMD_DIR"])
    units.mkdir(parents=True, exist_ok=True)
    (units / "ollama.service").write_text("[Service]\nExecStart=/usr/local/bin/ollama serve\n")
    dropin = units / "ollama.service.d" / "moeplug.conf"
    hosts = [RpcServer(patched_build).start() for _ in range(2)]
    rpc = ",".join(h.endpoint for h in hosts)
    try:
        r = moeplug(None, "install", "ollama:beta", "--rpc", rpc, "--rpc-budget", "848MiB,848MiB", "--no-serve",
                    "--ctx", "1024", "--profile-tokens", "16", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        args = json.loads(r.stdout)["plan"]["server_args"]
        assert args[args.index("--rpc") + 1] == rpc
        r = moeplug(None, "hook", "ollama", "--ollama-dir", str(prefix), "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["environment"]["LLAMA_ARG_RPC"] == rpc and doc["environment"]["OLLAMA_MAX_LOADED_MODELS"] == "1"
        assert doc["remote_devices"].startswith(f"LLAMA_ARG_RPC={rpc} (the plan of beta-latest): every model Ollama starts")
        assert f"Environment=LLAMA_ARG_RPC={rpc}\n" in dropin.read_text()
        assert "remote devices: LLAMA_ARG_RPC=" in doc["next"]

        # llama-server as Ollama starts it (its flags alone, no --rpc), in that environment: on both hosts
        tokens, log = answer(lib / "llama-server", ollama["blobs"]["beta"], tmp_path / "beta.log", doc["environment"])
        assert tokens
        for i, h in enumerate(hosts):
            assert f"using device RPC{i} ({h.endpoint})" in log, log[-3000:]

        # a re-plan without remote devices: the drop-in no longer names them (Ollama reads it at its restart)
        r = moeplug(None, "install", "ollama:beta", "--rpc", "none", "--no-serve", "--ctx", "1024", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "LLAMA_ARG_RPC" not in dropin.read_text() and "OLLAMA_MAX_LOADED_MODELS" not in dropin.read_text()
        assert "Environment=LLAMA_ARG_MOE_CACHE_SLOTS=auto\n" in dropin.read_text()

        # two plans on different hosts: one environment cannot hold both lists, so it holds none
        for model, given, budgets in (("beta", rpc, "848MiB,848MiB"), ("alpha", hosts[0].endpoint, "1GiB")):
            r = moeplug(None, "install", f"ollama:{model}", "--rpc", given, "--rpc-budget", budgets, "--no-serve",
                        "--ctx", "1024", "--json")
            assert r.returncode == 0, r.stderr[-3000:]
        assert "LLAMA_ARG_RPC" not in dropin.read_text()
        r = moeplug(None, "hook", "ollama", "--ollama-dir", str(prefix), "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert "LLAMA_ARG_RPC" not in doc["environment"]
        assert doc["remote_devices"].startswith(f"the installed plans name different remote devices (alpha-latest: "
                                                f"{hosts[0].endpoint}; beta-latest: {rpc})")
    finally:
        for h in hosts:
            h.stop()
        assert moeplug(None, "hook", "remove", "ollama").returncode == 0
        (units / "ollama.service").unlink()
    assert tree_digest(lib) == ollama["stock"] and not dropin.exists()


def test_a_slow_bus_plan_stays_static_through_ollama(ollama, tmp_path: Path) -> None:
    """The demo (its slots in RAM, a quarter of its experts whatever the costs say) planned with this
    machine's defaults follows the prompt (dynamic, 8 uploads a batch); planned again with a calibration
    that reads a narrow bus (6 GB/s), static: not one upload a batch would keep to its share of the bus.
    Ollama's environment, the same for every model, runs each plan as made (it used to give every model
    the dynamic policy and 8 uploads a batch, whatever its plan said)."""
    lib, prefix = ollama["lib"], ollama["prefix"]
    cal = tmp_path / "slow-bus.json"
    cal.write_text(json.dumps({"cpu_expert_bytes_per_s": 30e9, "h2d_bytes_per_s": 6e9}))
    try:
        for extra, policy in (([], "dynamic"), (["--calibration", str(cal)], "static")):
            r = moeplug(None, "install", "demo", *extra, "--no-serve", "--ctx", "1024", "--json")
            assert r.returncode == 0, r.stderr
            inst = json.loads(r.stdout)
            assert inst["plan"]["cache_policy"] == policy and "--moe-cache-slots" in inst["plan"]["server_args"]
            r = moeplug(None, "hook", "ollama", "--ollama-dir", str(prefix), "--json")
            assert r.returncode == 0, r.stderr
            env = json.loads(r.stdout)["environment"]  # nothing else: the demo's plan holds its slots in RAM itself
            _, log = answer(lib / "llama-server", Path(inst["model"]), tmp_path / f"demo-{policy}.log", env)
            [settings] = [dict(kv.split("=", 1) for kv in ln.split()[1:]) for ln in cache_lines(log)
                          if ln.startswith("moe-settings:")]
            assert (settings["policy"], settings["device"], settings["slots"]) == (policy, "CPU", "8"), settings
            assert settings["uploads"] == ("8" if policy == "dynamic" else "4")  # static: the flag's default, unused
            assert any(re.match(rf"moe-cache: 4 layers x 8 slots, .*policy {policy}", ln) for ln in cache_lines(log))
    finally:
        assert moeplug(None, "hook", "remove", "ollama").returncode == 0
