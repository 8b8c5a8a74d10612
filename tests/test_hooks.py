"""`moeplug hook`: llama-server router presets and llama-swap fragments made from the installed
plans, against the real pinned llama-server in router mode and the llama-swap schema moeplug ships (and
llama-swap's own config-schema.json where ../shared has it).

Three synthetic models are installed once for the module in temp XDG homes, each with a plan of its
own: the demo through the real `moeplug install` (dynamic slots), a second model through the same
library calls (profile, a static plan with its slots held in RAM as the demo's, its copies ahead
off), and a third whose check chose stock's placement. Every road (the router, llama-swap's
commands, `moeplug serve`) must start each with its own plan, read back from the engine's settings
line, never from moeplug's files. Each test gets its own state home, so the hook records of one test
are not the next test's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import jsonschema
import pytest
import requests
import yaml
from helpers import moeplug, one_line_error, use_xdg_homes

from moeplug.hooks.installed import flag_pairs
from moeplug.serving.server import free_port

pytestmark = pytest.mark.native

ROOT = Path(__file__).resolve().parent.parent
# llama-swap's own schema, where a checkout sits beside the project's shared data (not on a user's machine):
# the tests below check against it as well when it is there; what they need is in the repository
LLAMA_SWAP = ROOT.parent / "shared" / "data" / "llama-swap"
# a user's llama-swap config that moeplug's entries go beside (written for these tests)
SWAP_CONFIG = ROOT / "tests" / "data" / "llama-swap" / "config.yaml"


def wait_for_router(url: str, router: subprocess.Popen, log: Path, timeout: float = 60, path: str = "/models") -> None:
    """Until the router (or a server) answers `path`; its log's end where it exits or the time runs out first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(f"{url}{path}", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        assert router.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def store(patched_build, tmp_path_factory: pytest.TempPathFactory):
    """XDG homes holding three installed models: demo (dynamic, slots in RAM); other, static, its slots
    in RAM and its copies ahead off (as the planner turns them off on a GPU where few layers are partly
    resident: a flag of its own, --moe-cache-copy-ahead off); third, checked to stock's placement."""
    import time as clock

    from moeplug.core.fsutil import write_text_atomic
    from moeplug.serving.installed import InstalledModel, Verdict, installed_dir
    from moeplug.operations.install import demo_slots, ensure_profile, plan_for
    from moeplug.planner.request import PlanRequest
    from moeplug.model.inspect import inspect_model
    from moeplug.model.synth import ModelSpec, make_model

    root = tmp_path_factory.mktemp("hooks")
    with pytest.MonkeyPatch.context() as mp:
        use_xdg_homes(mp, root)
        r = subprocess.run([sys.executable, "-m", "moeplug", "install", "demo", "--no-serve", "--ctx", "1024"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]

        for name, seed in (("other", 99), ("third", 7)):
            path = make_model(ModelSpec(arch="qwen3moe", layers=4, experts=32, used=4, embd=256, expert_ff=256,
                                        dtype="q8_0", seed=seed, name=name), root / f"{name}.gguf")[0]
            profile = ensure_profile(path, patched_build.binary("llama-moe-profile"), 16, ["codeish"])
            info = inspect_model(path)
            plan = plan_for(info, PlanRequest(1024, slots_in_ram=demo_slots(info, True), policy="static"), profile)
            assert plan.cache_policy == "static" and "--moe-cache-device" in plan.server_args
            doc = plan.to_json()
            if name == "other":
                doc |= {"copy_ahead": False, "server_args": plan.server_args + ["--moe-cache-copy-ahead", "off"]}
            verdict = None if name == "other" else Verdict(
                placement="stock", decode=0.5, prefill=0.9, decode_lowest=0.4, prompts=4, budget_bytes=None,
                checked_at=clock.time(), chosen="stock")
            record = InstalledModel(name=name, ref=str(path), path=str(path), profile=str(profile),
                                    build_id=patched_build.build_id, ctx=1024, plan=doc, slots_on_cpu=True,
                                    verdict=verdict)
            write_text_atomic(installed_dir() / f"{name}.json", json.dumps(asdict(record), indent=2) + "\n")
        yield root


@pytest.fixture
def hooks_home(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The module's installed models, a fresh state home (no hooks yet); env for the CLI."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return dict(os.environ)


def installed() -> dict[str, object]:
    from moeplug.serving.installed import list_installed

    return {m.name: m for m in list_installed()}


MODELS = ["demo", "other", "third"]


def engine_settings(log: str) -> list[dict[str, str]]:
    """Every 'moe-settings: k=v ...' line the engine logged (common_moeplug_settings), as dicts."""
    return [dict(kv.split("=", 1) for kv in line.split()) for line in re.findall(r"moe-settings: (.*)", log)]


def own_settings(m: object) -> dict[str, str]:
    """What the engine must report for an installed model: stock's placement, or its plan's every
    --moe-cache-KEY flag under KEY (the plan file's keys)."""
    if m.placement == "stock":  # type: ignore[attr-defined]
        return {"placement": "stock"}
    flags = dict(flag_pairs(m.plan.server_args))  # type: ignore[attr-defined]
    keys = ("slots", "max-batch", "policy", "half-life", "uploads", "stream", "offload-min-batch", "copy-ahead",
            "device")
    return {"placement": "moeplug", **{k: flags["--moe-cache-" + k] for k in keys if "--moe-cache-" + k in flags}}


def runs_its_own_plan(name: str, log: str, plan: str = "none") -> None:
    """The engine's log of one server of `name`: the settings of its own plan, slots only where it has
    them (stock's placement: the engine never engaged, or was not asked); plan: the plan file it read
    ("none": its flags alone)."""
    m = installed()[name]
    want = own_settings(m)
    if want["placement"] == "stock":
        assert all(s["placement"] == "stock" for s in engine_settings(log)), engine_settings(log)
        assert not re.search(r"moe-cache: \d+ layers x", log), log[-2000:]
        return
    [got] = engine_settings(log)
    assert {k: got[k] for k in want} == want, (name, got, want)
    assert got["plan"] == plan and re.search(r"moe-cache: 4 layers x 8 slots", log)


def metrics_settings(page: str) -> dict[str, str] | None:
    """The settings the engine publishes on /metrics (llamacpp:moe_cache_settings{...} 1), in the log
    line's keys; None without the gauge."""
    found = re.findall(r"^llamacpp:moe_cache_settings\{(.*)\} 1$", page, re.M)
    if not found:
        return None
    [labels] = found
    return {k.replace("_", "-"): v for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)}


def plan_file(name: str) -> str:
    from moeplug.hooks.plan_files import plan_path

    return str(plan_path(Path(installed()[name].profile)))


def without_moeplug_blocks(text: str) -> str:
    return re.sub(r"; >>> moeplug (\S+) .*?; <<< moeplug \1\n", "", text, flags=re.S)


# ---------------------------------------------------------------------------------------------
# llama-server router mode


def test_router_starts_each_model_with_moeplugs_flags_and_swaps(hooks_home: dict[str, str], tmp_path: Path) -> None:
    preset = tmp_path / "router.ini"
    preset.write_text("; my router\n[*]\nc = 2048 ; shared by every model\n")
    port = free_port()
    r = moeplug(hooks_home, "hook", "llama-server", "--preset", str(preset), "--port", str(port), "--models-max", "2",
                "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["hook"]["models"] == MODELS and doc["changed"]
    command = doc["router_command"]
    # every choice of a plan is a flag of its own section: the router's environment, which every child
    # inherits, holds none of them (no merged environment)
    assert "=" not in command.split()[0]
    assert "--models-preset" in command and "--models-max 2" in command

    log = tmp_path / "router.log"
    with open(log, "wb") as out:  # the printed command, as a user pastes it
        router = subprocess.Popen(["sh", "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_router(url, router, log)

        models = installed()
        for name in MODELS:
            r2 = requests.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
            assert r2.status_code == 200, r2.text
            assert r2.json()["model"] == name and r2.json()["choices"][0]["message"]["content"]
            status = {m["id"]: m["status"] for m in requests.get(f"{url}/models", timeout=10).json()["data"]}
            assert status[name]["value"] == "loaded"
            # the child ran with the installed plan's flags, in the router's long spelling
            args = status[name]["args"]
            assert args[args.index("--model") + 1] == models[name].path
            if models[name].placement == "stock":
                assert not any(a.startswith("--moe-cache") for a in args), args
                continue
            plan = dict(flag_pairs(models[name].plan.server_args))
            assert args[args.index("--ctx-size") + 1] == plan["-c"] == "1024"  # the model's, over [*]'s 2048
            # the cache's choices are one key: the model's plan file, which the engine reads itself
            assert [a for a in args if a.startswith("--moe-cache")] == ["--moe-cache-plan"]
            assert args[args.index("--moe-cache-plan") + 1] == plan_file(name)
        # --models-max 2: asking for third swapped demo out, other stayed
        assert status["demo"]["value"] == "unloaded" and status["other"]["value"] == "loaded"

        text = log.read_text(errors="replace")
        ports = dict(re.findall(r"spawning server instance with name=(\S+) on port (\d+)", text))
        assert sorted(ports) == MODELS
        for name, child in ports.items():
            own = plan_file(name) if models[name].placement != "stock" else "none"
            runs_its_own_plan(name, "\n".join(re.findall(rf"\[\s*{child}\] (.*)", text)), own)
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)  # its own session: the router and its children
        router.wait(timeout=30)


def test_moeplug_serve_runs_each_models_own_plan(hooks_home: dict[str, str]) -> None:
    """`moeplug serve`: each of the three models with its own plan's settings as the engine took them,
    the stock-placed one without slots; /metrics publishes the settings of the log line."""
    try:
        for name in MODELS:
            r = moeplug(hooks_home, "serve", name, "--json")
            assert r.returncode == 0, r.stderr
            server = json.loads(r.stdout)["server"]
            log = Path(server["log"]).read_text(errors="replace")
            runs_its_own_plan(name, log)
            published = metrics_settings(requests.get(f"{server['url']}/metrics", timeout=30).text)
            if installed()[name].placement == "stock":
                assert published is None  # stock's flags: the engine was not asked
            else:
                assert [published] == engine_settings(log)
    finally:
        moeplug(hooks_home, "stop", "--all")


def test_a_plan_file_of_stocks_placement_runs_without_the_cache_and_says_so_on_metrics(hooks_home: dict[str, str],
                                                                                       tmp_path: Path) -> None:
    """The plan file of the model whose check chose stock's placement, named alone with --moe-cache-plan: the
    engine takes no slots, and /metrics says which placement it took (the settings gauge, no cache counters)."""
    from moeplug.hooks.plan_files import plan_text, write_plan_files
    from moeplug.native.build import installed_builds
    from moeplug.serving.server import start_server

    models = installed()
    write_plan_files(list(models.values()))
    third = models["third"]
    assert "placement = stock" in plan_text(third)
    [build] = [b for b in installed_builds() if b.build_id == third.build_id]
    with start_server(build.binary("llama-server"), Path(third.path), tmp_path / "stock.log", ctx=1024, threads=2,
                      extra_args=["--metrics", "--moe-cache-plan", plan_file("third")]) as srv:
        srv.wait_healthy(timeout=120)
        srv.complete("Hello", n_predict=4)
        page = requests.get(f"{srv.url}/metrics", timeout=10).text
    log = (tmp_path / "stock.log").read_text(errors="replace")
    assert [s["placement"] for s in engine_settings(log)] == ["stock"] and "moe-cache: not engaged" in log
    published = metrics_settings(page)
    assert published is not None and published["placement"] == "stock" and published["plan"] == plan_file("third")
    assert "moe_cache_selections_total" not in page


USER_PRESET = (
    "; shared settings, and my own model\r\n"
    "version = 1\r\n"
    "\r\n"
    "[*]\r\n"
    "c = 4096   # a comment after a value\r\n"
    "\r\n"
    "[mine]\r\n"
    "model = /models/mine.gguf\r\n"
    "# mine stays mine\r\n"
)


def test_preset_update_keeps_the_users_sections_and_comments_byte_for_byte(hooks_home: dict[str, str],
                                                                          tmp_path: Path) -> None:
    from moeplug.operations.install import replan
    from moeplug.planner.request import PlanChoices

    preset = tmp_path / "router.ini"
    preset.write_bytes(USER_PRESET.encode())
    os.chmod(preset, 0o640)
    assert moeplug(hooks_home, "hook", "llama-server", "--preset", str(preset)).returncode == 0
    text = preset.read_bytes().decode()
    assert text.startswith(USER_PRESET) and without_moeplug_blocks(text) == USER_PRESET
    assert "[demo]\n" in text and "[other]\n" in text and "load-on-startup = false\n" in text
    assert (tmp_path / "router.ini.moeplug-backup").read_bytes() == USER_PRESET.encode()
    assert preset.stat().st_mode & 0o777 == 0o640

    # the user edits their part; a re-plan (as `serve --ctx` makes) updates moeplug's section in place
    edited = text.replace("# mine stays mine\r\n", "# mine stays mine\r\nctx-size = 512\r\n")
    preset.write_bytes(edited.encode())
    replan(installed()["demo"], PlanChoices(ctx=2048))
    after = preset.read_bytes().decode()
    assert without_moeplug_blocks(after) == without_moeplug_blocks(edited)
    demo = re.search(r"\[demo\]\n(.*?); <<<", after, re.S)[1]
    assert "c = 2048\n" in demo
    assert (tmp_path / "router.ini.moeplug-backup").read_bytes() == USER_PRESET.encode()  # the first version
    replan(installed()["demo"], PlanChoices(ctx=1024))

    # the hook is listed, and removing it gives the user's file back, byte for byte
    listed = json.loads(moeplug(hooks_home, "hook", "list", "--json").stdout)["hooks"]
    assert [(h["target"], h["file"], h["error"]) for h in listed] == [("llama-server", str(preset), None)]
    assert moeplug(hooks_home, "hook", "remove", str(preset)).returncode == 0
    assert preset.read_bytes() == without_moeplug_blocks(edited).encode()
    assert json.loads(moeplug(hooks_home, "hook", "list", "--json").stdout)["hooks"] == []


def test_print_shows_the_plans_flags_without_writing(hooks_home: dict[str, str]) -> None:
    r = moeplug(hooks_home, "hook", "llama-server", "--print")
    assert r.returncode == 0, r.stderr
    from moeplug.hooks.plan_files import served_args
    from moeplug.planner.server_flags import stock_args

    models = installed()
    for name, m in models.items():
        section = re.search(rf"^\[{name}\]\n(.*?)^; <<< moeplug {name}$", r.stdout, re.S | re.M)[1]
        keys = [line.split(" = ", 1) for line in section.splitlines()]
        served = stock_args(m.plan) if m.placement == "stock" else served_args(m)  # its check's choice
        assert m.placement == "stock" or Path(plan_file(name)).is_file()  # written for what the section names
        expected = [["model", m.path]] + [[f.lstrip("-"), v if v is not None else "true"]
                                          for f, v in flag_pairs(served)]
        assert keys == [*expected, ["load-on-startup", "false"]]
    assert json.loads(moeplug(hooks_home, "hook", "list", "--json").stdout)["hooks"] == []


@pytest.mark.parametrize("content", [b'{"models": ["demo"]}\n', b"[demo\nmodel = x\n", b"\xff\xfe\x00binary"])
def test_a_broken_preset_is_refused_in_one_line_and_left_untouched(hooks_home: dict[str, str], tmp_path: Path,
                                                                    content: bytes) -> None:
    preset = tmp_path / "router.ini"
    preset.write_bytes(content)
    one_line_error(moeplug(hooks_home, "hook", "llama-server", "--preset", str(preset)), 1, str(preset))
    assert preset.read_bytes() == content
    assert [p.name for p in tmp_path.iterdir() if p.name != "state"] == ["router.ini"]  # no backup, no temp file
    assert json.loads(moeplug(hooks_home, "hook", "list", "--json").stdout)["hooks"] == []


def test_a_users_section_named_like_a_model_is_a_clash(hooks_home: dict[str, str], tmp_path: Path) -> None:
    preset = tmp_path / "router.ini"
    preset.write_text("[demo]\nmodel = /elsewhere/demo.gguf\n")
    one_line_error(moeplug(hooks_home, "hook", "llama-server", "--preset", str(preset)), 1, "[demo]")
    assert preset.read_text() == "[demo]\nmodel = /elsewhere/demo.gguf\n"


# ---------------------------------------------------------------------------------------------
# llama-swap


def swap_schemas() -> list[dict[str, object]]:
    """The schema moeplug ships (llama_swap.OWN_SCHEMA: what it checks a fragment against without
    llama-swap's), and llama-swap's own config-schema.json where ../shared has it."""
    from moeplug.hooks.llama_swap import OWN_SCHEMA

    real = LLAMA_SWAP / "config-schema.json"
    return [OWN_SCHEMA, *([json.loads(real.read_text())] if real.is_file() else [])]


def valid_for_llama_swap(doc: object) -> None:
    for schema in swap_schemas():
        jsonschema.Draft7Validator(schema).validate(doc)


@pytest.mark.skipif(not (LLAMA_SWAP / "config-schema.json").is_file(),
                    reason=f"llama-swap's own schema is not here: {LLAMA_SWAP / 'config-schema.json'} is missing "
                           f"(the fragment is still checked against the schema moeplug ships)")
def test_the_shipped_schema_and_config_agree_with_llama_swaps_own() -> None:
    """What the repository ships stands for llama-swap's files: the test config is valid for llama-swap's
    schema, and whatever that schema refuses in an entry moeplug writes, the shipped one refuses too."""
    from moeplug.hooks.llama_swap import OWN_SCHEMA

    real = json.loads((LLAMA_SWAP / "config-schema.json").read_text())
    jsonschema.Draft7Validator(real).validate(yaml.safe_load(SWAP_CONFIG.read_text()))
    for bad in ({"models": {"m": {"cmd": ""}}}, {"models": {"m": {"ttl": 5}}},
                {"models": {"m": {"cmd": "x", "env": ["a=b"]}}}, {"models": {"m": {"cmd": "x", "checkEndpoint": "health"}}},
                {}):
        assert not jsonschema.Draft7Validator(real).is_valid(bad), bad
        assert not jsonschema.Draft7Validator(OWN_SCHEMA).is_valid(bad), bad


def test_llama_swap_fragment_is_valid_and_runs_the_plans_flags(hooks_home: dict[str, str], tmp_path: Path) -> None:
    from moeplug.hooks.plan_files import served_args

    folder = tmp_path / "swap.d"
    folder.mkdir()
    (folder / "00-main.yaml").write_text(SWAP_CONFIG.read_text())
    r = moeplug(hooks_home, "hook", "llama-swap", "--config-dir", str(folder), "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["00-main.yaml", "moeplug.yaml"]
    fragment = yaml.safe_load((folder / "moeplug.yaml").read_text())
    valid_for_llama_swap(fragment)
    assert sorted(fragment) == ["models"] and sorted(fragment["models"]) == MODELS
    for name, m in installed().items():
        entry = fragment["models"][name]
        assert entry["checkEndpoint"] == "/health" and entry["ttl"] == 300
        assert "env" not in entry  # every choice of the plan is a flag of its own command
        argv = shlex.split(entry["cmd"])
        binary = Path(argv[0])
        assert binary.name == "llama-server" and binary.parent.parent.name == m.build_id
        assert argv[argv.index("--port") + 1] == "${PORT}" and argv[argv.index("-m") + 1] == m.path
        if m.placement != "stock":  # the plan's flags, its cache's choices as one: its plan file
            assert argv[-len(served_args(m)):] == served_args(m)
            assert [a for a in argv if a.startswith("--moe-cache")] == ["--moe-cache-plan"]
        else:
            assert not any(a.startswith("--moe-cache") for a in argv)

        # the command as llama-swap runs it: ${PORT} filled in, the entry's environment over its own;
        # --metrics added, as a user's entry may, to read the settings the engine publishes
        port = free_port()
        log = tmp_path / f"swap-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*(a.replace("${PORT}", str(port)) for a in argv), "--metrics"], stdout=out,
                                    stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_for_router(f"http://127.0.0.1:{port}", proc, log, path="/health")
            published = metrics_settings(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        text = log.read_text(errors="replace")
        runs_its_own_plan(name, text, plan_file(name) if m.placement != "stock" else "none")
        assert published == (engine_settings(text) or [None])[0]
    # merged on top of the example config, as llama-swap merges the folder, it is still valid
    main = yaml.safe_load(SWAP_CONFIG.read_text())
    main["models"].update(fragment["models"])
    valid_for_llama_swap(main)


def test_llama_swap_clash_with_another_fragment_is_refused(hooks_home: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "swap.d"
    folder.mkdir()
    assert moeplug(hooks_home, "hook", "llama-swap", "--config-dir", str(folder)).returncode == 0
    before = (folder / "moeplug.yaml").read_bytes()
    (folder / "zz-mine.yaml").write_text("models:\n  mine:\n    cmd: llama-server --port ${PORT}\n"
                                         "    aliases: [other]\n")
    one_line_error(moeplug(hooks_home, "hook", "llama-swap", "--config-dir", str(folder)), 1, "zz-mine.yaml", "'other'")
    assert (folder / "moeplug.yaml").read_bytes() == before
    # the recorded hook meets the clash at the next regeneration too: reported, file kept
    from moeplug.hooks import refresh_hooks

    records = refresh_hooks(list(installed().values()))
    assert "zz-mine.yaml" in (records[0].error or "") and (folder / "moeplug.yaml").read_bytes() == before


def test_an_interrupted_llama_swap_write_leaves_no_yaml(hooks_home: dict[str, str], tmp_path: Path) -> None:
    """The writer dies between writing the fragment and renaming it into place."""
    folder = tmp_path / "swap.d"
    folder.mkdir()
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from moeplug.hooks.maintain import add_hook
        from moeplug.serving.installed import list_installed
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # the crash, at the worst moment
        add_hook("llama-swap", Path({str(folder)!r}), list_installed())
    """)
    r = subprocess.run([sys.executable, "-c", script], env=hooks_home, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert list(folder.glob("*.yaml")) == []
    left = [p.name for p in folder.iterdir()]
    assert len(left) == 1 and left[0].startswith(".moeplug.yaml.") and left[0].endswith(".tmp")


def test_llama_swap_single_file_keeps_everything_else(hooks_home: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    example = SWAP_CONFIG.read_bytes()
    config.write_bytes(example)
    assert moeplug(hooks_home, "hook", "llama-swap", "--file", str(config)).returncode == 0
    text = config.read_text()
    doc = yaml.safe_load(text)
    valid_for_llama_swap(doc)
    assert {"demo", "other", "qwen-coder", "embedder"} <= set(doc["models"])
    kept = re.sub(r"\n *# >>> moeplug .*?# <<< moeplug", "", text, flags=re.S)
    assert kept.encode() == example and (tmp_path / "config.yaml.moeplug-backup").read_bytes() == example
    assert moeplug(hooks_home, "hook", "remove", "--all").returncode == 0
    assert config.read_bytes() == example


# ---------------------------------------------------------------------------------------------
# remote devices: a plan with --rpc, run by the router and by llama-swap's command


@pytest.fixture(scope="module")
def remote_store(patched_build, tmp_path_factory: pytest.TempPathFactory):
    """XDG homes (the builds shared) holding the demo installed over two rpc-servers of the patched
    build (its plan's server args carry --rpc), and the two servers, running."""
    from helpers import RpcServer, xdg_homes

    root = tmp_path_factory.mktemp("hooks-rpc")
    env = xdg_homes(root)
    hosts = [RpcServer(patched_build, root / f"rpc-server-{i}.log").start() for i in range(2)]
    try:
        r = moeplug(env, "install", "demo", "--ctx", "1024", "--no-serve", "--json", "--rpc",
                    ",".join(h.endpoint for h in hosts), "--rpc-budget", "848MiB,848MiB")
        assert r.returncode == 0, r.stderr[-3000:]
        plan = json.loads(r.stdout)["plan"]
        assert dict(flag_pairs(plan["server_args"]))["--rpc"] == ",".join(h.endpoint for h in hosts)
        yield {"env": env, "hosts": hosts, "plan": plan}
    finally:
        for h in hosts:
            h.stop()


def ran_on(log: str, hosts: list) -> bool:
    """llama.cpp's log (at -lv 4, as moeplug serves) says it used a device of each host."""
    return all(re.search(rf"using device RPC\d+ \({re.escape(h.endpoint)}\)", log) for h in hosts)


def test_router_runs_a_plan_on_its_remote_devices(remote_store: dict, tmp_path: Path) -> None:
    env, hosts, plan = remote_store["env"], remote_store["hosts"], remote_store["plan"]
    rpc = ",".join(h.endpoint for h in hosts)
    preset = tmp_path / "router.ini"
    port = free_port()
    r = moeplug(env, "hook", "llama-server", "--preset", str(preset), "--port", str(port), "--json")
    assert r.returncode == 0, r.stderr
    block = re.search(r"^; >>> moeplug demo (.*?)^; <<< moeplug demo$", preset.read_text(), re.S | re.M)[1]
    assert f"; runs on the remote devices of {rpc}: an rpc-server serves one client at a time" in block
    assert f"\nrpc = {rpc}\n" in block and "\ntensor-split = " in block
    assert "--models-max 1" in json.loads(r.stdout)["router_command"]  # an rpc-server serves one client at a time

    log = tmp_path / "router.log"
    clients = [h.clients() for h in hosts]
    with open(log, "wb") as out:
        router = subprocess.Popen(["sh", "-c", json.loads(r.stdout)["router_command"]], stdout=out,
                                  stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_router(url, router, log)
        r2 = requests.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]})
        assert r2.status_code == 200, r2.text
        args = {m["id"]: m["status"] for m in requests.get(f"{url}/models", timeout=10).json()["data"]}["demo"]["args"]
        assert args[args.index("--rpc") + 1] == rpc
        assert args[args.index("--tensor-split") + 1] == ",".join(map(str, plan["tensor_split"]))
        # the child (its log at the router's verbosity names no device) connected to both hosts
        assert all(h.clients() > n for h, n in zip(hosts, clients)), clients
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)  # its own process group: the router and its child
        router.wait(timeout=30)


def test_llama_swaps_command_runs_a_plan_on_its_remote_devices(remote_store: dict, tmp_path: Path) -> None:
    env, hosts = remote_store["env"], remote_store["hosts"]
    folder = tmp_path / "swap.d"
    folder.mkdir()
    r = moeplug(env, "hook", "llama-swap", "--config-dir", str(folder))
    assert r.returncode == 0, r.stderr
    entry = yaml.safe_load((folder / "moeplug.yaml").read_text())["models"]["demo"]
    valid_for_llama_swap({"models": {"demo": entry}})
    argv = shlex.split(entry["cmd"])
    assert argv[argv.index("--rpc") + 1] == ",".join(h.endpoint for h in hosts)

    port = free_port()  # as llama-swap runs it: ${PORT} given, the entry's environment added
    log = tmp_path / "swap-demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([a.replace("${PORT}", str(port)) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **dict(e.split("=", 1) for e in entry.get("env", []))})
    try:
        wait_for_router(f"http://127.0.0.1:{port}", proc, log, 120, entry["checkEndpoint"])
        r2 = requests.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hello", "n_predict": 8}, timeout=300)
        assert r2.status_code == 200, r2.text
        assert ran_on(log.read_text(errors="replace"), hosts), log.read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------
# the watcher


def test_watcher_regenerates_after_a_profile_is_replaced_and_not_for_other_files(hooks_home: dict[str, str],
                                                                                 tmp_path: Path) -> None:
    from moeplug.hooks.maintain import add_hook
    from moeplug.hooks.store import read_hooks
    from moeplug.operations.watch import watch_store
    from moeplug.serving.installed import installed_dir
    from moeplug.profile import merge_profiles, read_profile, write_profile

    preset = tmp_path / "router.ini"
    add_hook("llama-server", preset, list(installed().values()))
    profile = Path(installed()["other"].profile)
    old_digest = _profile_digest(preset, "other")
    # a profile made elsewhere (as a cron job would): the same model's runs, counted twice
    replacement = tmp_path / "new-profile.gguf"
    write_profile(merge_profiles([read_profile(profile), read_profile(profile)]), replacement)

    watcher = watch_store()
    try:
        # unrelated files: no regeneration at all
        updated = read_hooks()[0].updated
        (profile.parent / "README.txt").write_text("not a profile\n")
        (installed_dir() / "notes.md").write_text("not a model record\n")
        (installed_dir() / ".other.json.123.tmp").write_text("{}")  # someone's temporary file
        (tmp_path / "elsewhere.json").write_text("{}")
        time.sleep(1.5)
        assert read_hooks()[0].updated == updated

        os.replace(replacement, profile)
        replaced = time.monotonic()
        while _profile_digest(preset, "other") == old_digest:
            assert time.monotonic() - replaced < 2.0, "the preset was not regenerated within 2 s"
            time.sleep(0.05)
        assert _profile_digest(preset, "other") == _sha(profile)[:16]
        # the record is stored just after the file is written: give it the rest of the 2 s
        while read_hooks()[0].updated == updated and time.monotonic() - replaced < 2.0:
            time.sleep(0.05)
        assert read_hooks()[0].updated > updated and read_hooks()[0].error is None
    finally:
        watcher.stop()


def _sha(path: Path) -> str:
    from moeplug.core.fsutil import sha256_file

    return sha256_file(path)


def _profile_digest(preset: Path, name: str) -> str:
    block = re.search(rf"; >>> moeplug {name} (.*?); <<< moeplug {name}\n", preset.read_text(), re.S)[1]
    return re.search(r"^; profile \S+ sha256:(\w+)$", block, re.M)[1]


def test_profiling_an_installed_model_again_rewrites_its_hooks(hooks_home: dict[str, str], tmp_path: Path) -> None:
    preset = tmp_path / "router.ini"
    assert moeplug(hooks_home, "hook", "llama-server", "--preset", str(preset)).returncode == 0
    demo, other = _profile_digest(preset, "demo"), _profile_digest(preset, "other")
    m = installed()["other"]
    r = moeplug(hooks_home, "profile", m.path, "-n", "4", "--prompts", "chatty")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _profile_digest(preset, "other") == _sha(Path(m.profile))[:16] != other
    assert _profile_digest(preset, "demo") == demo


def test_hook_watch_service_regenerates_and_stops_on_ctrl_c(hooks_home: dict[str, str], tmp_path: Path) -> None:
    from moeplug.core.fsutil import write_text_atomic
    from moeplug.hooks.store import read_hooks
    from moeplug.serving.installed import installed_dir

    preset = tmp_path / "router.ini"
    assert moeplug(hooks_home, "hook", "llama-server", "--preset", str(preset)).returncode == 0
    updated = read_hooks()[0].updated
    # SIGINT as a terminal's Ctrl-C finds it: a test run started in the background (`cmd &` without
    # job control) ignores SIGINT, and a child would inherit that
    proc = subprocess.Popen([sys.executable, "-m", "moeplug", "hook", "watch"], env=hooks_home, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "watching" in proc.stderr.readline()
        record = installed_dir() / "demo.json"
        write_text_atomic(record, record.read_text())  # a record copied in again
        deadline = time.monotonic() + 2
        while read_hooks()[0].updated == updated:
            assert time.monotonic() < deadline, "the service did not regenerate within 2 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "moeplug: interrupted"


def test_hook_usage_errors_are_one_line(hooks_home: dict[str, str], tmp_path: Path) -> None:
    one_line_error(moeplug(hooks_home, "hook", "llama-server"), 2, "--preset")
    one_line_error(moeplug(hooks_home, "hook", "llama-swap"), 2, "--config-dir")
    one_line_error(moeplug(hooks_home, "hook", "llama-swap", "--config-dir", str(tmp_path / "none")), 1, "no such folder")
    one_line_error(moeplug(hooks_home, "hook", "remove", str(tmp_path / "x.ini")), 1, "no hook")
