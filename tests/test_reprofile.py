"""`moeplug reprofile`: decay, drift, replacing the profile under the model's lock, rollback, restarts
that wait for idle; and the served path against llama-server's --moe-cache-record when the build has it.

End-to-end tests run the real command (a child process, as cron runs it) on the demo model in
fresh XDG homes sharing the built binaries; "unlike" traffic is a prompt file of random numbers,
which this model routes differently from the bundled code and chat prompts.
"""

from __future__ import annotations

import fcntl
import json
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers import fixture_spec, moeplug, xdg_homes

XDG = ("XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")


# ---------------------------------------------------------------------------------------------
# decay and weights (pure)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moeplug.model.synth import make_model

    return make_model(fixture_spec("qwen3moe"), tmp_path_factory.mktemp("rp") / "m.gguf")[0]


def profile_of(model: Path, favourite: int, steps: int, label: str, decode_share: float = 0.5):
    """A profile of `model` whose every token selects `favourite` and the expert after it, over 4 prompts."""
    from moeplug.profile import Profile, ProfileSource, model_fingerprint

    fp = model_fingerprint(model)
    n_layers = sum(1 for t in fp.expert_tensors if "ffn_down_exps" in t)
    ids = np.array([favourite, (favourite + 1) % fp.n_expert], dtype=np.int16)
    seq = np.broadcast_to(ids, (steps, n_layers, fp.n_expert_used)).copy()
    meta = np.zeros((steps, 3), dtype=np.int32)
    meta[:, 0] = np.arange(steps) * 4 // steps
    meta[:, 2] = (np.arange(steps) % 100) < 100 * decode_share
    counts = {}
    for phase in (0, 1):
        c = np.zeros((n_layers, fp.n_expert), dtype=np.int64)
        for layer in range(n_layers):
            c[layer] = np.bincount(seq[meta[:, 2] == phase, layer].ravel(), minlength=fp.n_expert)
        counts[phase] = c
    tensors = [t for t in fp.expert_tensors if "ffn_down_exps" in t]
    return Profile(fp, tensors, counts[0], counts[1], [ProfileSource(label, ["a", "b", "c", "d"], seq, meta)])


def test_merge_decayed_ages_the_stored_counts_by_the_new_tokens(small_model: Path, tmp_path: Path) -> None:
    from moeplug.planner.allocate import hit_curves
    from moeplug.profile import read_profile, write_profile
    from moeplug.profile.format import merge_decayed

    old, new = profile_of(small_model, 0, 800, "old"), profile_of(small_model, 4, 200, "new")
    merged = merge_decayed(old, new, half_life=100)  # 200 new tokens: two half-lives
    assert [s.weight for s in merged.sources] == [0.25, 1.0]
    assert np.array_equal(merged.counts_decode, np.rint(old.counts_decode * 0.25) + new.counts_decode)
    assert merged.tokens(0) + merged.tokens(1) == 1000  # tokens recorded, not weighted

    path = write_profile(merged, tmp_path / "p.gguf")
    back = read_profile(path)
    assert [s.weight for s in back.sources] == [0.25, 1.0] and np.array_equal(back.counts_decode, merged.counts_decode)
    # the planner's curves follow the weights: 800 old tokens at 1/4 (200) against 200 new ones
    # split evenly; a long half-life keeps the old routing on top
    even = hit_curves(back, len(back.tensors), back.n_expert)
    assert even[0][2] == pytest.approx(0.5)
    kept = hit_curves(merge_decayed(old, new, half_life=10**9), len(back.tensors), back.n_expert)
    assert kept[0][2] == pytest.approx(0.8, abs=1e-3)
    # the default writes no weight key: a profile that was never decayed is the same file as before
    plain = write_profile(old, tmp_path / "old.gguf")
    assert b"moe_profile.source.0.weight" not in plain.read_bytes()
    assert b"moe_profile.source.0.weight" in path.read_bytes()


def test_live_counts_without_sequences_count_in_the_curves(small_model: Path) -> None:
    """A llama-server's live source has counts and tokens but no sequences: merged with a stored
    profile, its counts move the planner's curves (half to each fold)."""
    from dataclasses import replace

    from moeplug.planner.allocate import hit_curves
    from moeplug.profile.format import merge_decayed

    old = profile_of(small_model, 0, 400, "codeish")
    live = profile_of(small_model, 4, 4000, "live")
    live = replace(live, sources=[replace(live.sources[0], prompt_labels=[], seq=live.sources[0].seq[:0],
                                          meta=live.sources[0].meta[:0])], unsequenced_tokens=(2000, 2000))
    assert live.tokens(0) == 2000 and live.tokens(1) == 2000
    merged = merge_decayed(old, live, half_life=10**9)
    curves = hit_curves(merged, len(merged.tensors), merged.n_expert)
    resident = merged.counts_decode[0] + merged.counts_prefill[0]
    assert int(np.argmax(resident)) in (4, 5)
    assert curves[0][2] == pytest.approx(4000 / 4400, abs=0.01)


# ---------------------------------------------------------------------------------------------
# killed while writing (a child process writing a large profile, SIGKILLed mid-write)

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from test_reprofile import profile_of
    from moeplug.operations.reprofile import store_profile
    store_profile(profile_of(Path(sys.argv[1]), 4, int(sys.argv[2]), "big"), Path(sys.argv[4]))
""")


def tmp_size(path: Path) -> int:
    """Bytes of a file another process may rename away at any moment (0 when it is gone)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_sigkill_while_writing_leaves_the_old_or_the_new_profile(small_model: Path, tmp_path: Path) -> None:
    from moeplug.profile import read_profile, write_profile
    from moeplug.operations.reprofile import previous_path

    dest = tmp_path / "profiles" / "model.gguf"
    dest.parent.mkdir()
    old_bytes = write_profile(profile_of(small_model, 0, 100, "old"), dest).read_bytes()
    steps = 3_000_000  # about 150 MB of sequences: the write takes a while
    cmd = [sys.executable, "-c", WRITER, str(small_model), str(steps), str(Path(__file__).parent), str(dest)]

    killed_mid_write = False
    for _ in range(5):
        proc = subprocess.Popen(cmd)
        try:
            while proc.poll() is None:
                # the new profile's temporary file (not the copy of the old one kept as .previous,
                # which comes and goes quickly)
                tmps = [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.") and p.suffix == ".tmp"
                        and ".previous." not in p.name]
                if tmps and tmp_size(tmps[0]) > 1 << 20:  # the new profile is being written
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    killed_mid_write = True
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        assert dest.read_bytes() == old_bytes  # never a mix: the old profile, whole
        assert not previous_path(dest).exists() or previous_path(dest).read_bytes() == old_bytes
        if killed_mid_write:
            assert any(p.suffix == ".tmp" for p in dest.parent.iterdir())  # it died with the new one half-written
            break
    assert killed_mid_write

    assert subprocess.run(cmd, timeout=300).returncode == 0  # not killed: the new one, the old one kept
    assert read_profile(dest).tokens(0) + read_profile(dest).tokens(1) == steps
    assert previous_path(dest).read_bytes() == old_bytes


# ---------------------------------------------------------------------------------------------
# end to end on the demo model


def data(env: dict[str, str]) -> Path:
    return Path(env["XDG_DATA_HOME"]) / "moeplug"


def installed(env: dict[str, str]) -> dict:
    return json.loads((data(env) / "installed" / "demo.json").read_text())


def numbers_prompts(path: Path) -> Path:
    rng = random.Random(5)
    path.write_text("\n---\n".join(" ".join(str(rng.randint(0, 99999)) for _ in range(60)) for _ in range(12)))
    return path


def install_demo(env: dict[str, str]) -> Path:
    r = moeplug(env, "install", "demo", "--no-serve", "--ctx", "1024")
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(installed(env)["profile"])


pytest_native = pytest.mark.native


@pytest_native
@pytest.mark.usefixtures("patched_build")
def test_unlike_traffic_replans_keeps_the_old_profile_and_rolls_back(home: dict[str, str], tmp_path: Path) -> None:
    profile = install_demo(home)
    old_bytes, old_plan = profile.read_bytes(), installed(home)["plan"]
    preset = tmp_path / "router.ini"
    assert moeplug(home, "hook", "llama-server", "--preset", str(preset)).returncode == 0
    hooked = json.loads(moeplug(home, "hook", "list", "--json").stdout)

    r = moeplug(home, "reprofile", "demo", "--prompt-file", str(numbers_prompts(tmp_path / "numbers.txt")),
                "--apply", "never", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 0
    m = doc["models"][0]
    assert m["source"] == "prompts" and m["written"] and m["applied"] == "not served"
    assert m["gain"] >= 0.01 and m["new_predicted_hit_rate"] > m["measured_hit_rate"]
    assert [x["block"] for x in m["layers"]] == [0, 1, 2, 3]
    assert max(abs(x["drift"]) for x in m["layers"]) > 0.02  # the routing moved, layer by layer
    assert m["measured_hit_rate"] == pytest.approx(np.mean([x["measured"] for x in m["layers"]]))
    assert installed(home)["prompt_files"] == [str(tmp_path / "numbers.txt")]

    # replaced, the old one kept, re-planned, the hooks regenerated
    assert profile.read_bytes() != old_bytes
    assert Path(m["previous"]).read_bytes() == old_bytes
    new_plan = installed(home)["plan"]
    assert m["plan_changed"] and new_plan != old_plan
    assert new_plan["predicted_hit_rate"] == pytest.approx(m["new_predicted_hit_rate"], abs=0.02)
    from moeplug.profile import read_profile

    stored = read_profile(profile)
    assert [s.label for s in stored.sources] == ["codeish", "chatty", "codeish", "chatty", "numbers"]
    assert all(s.weight < 1 for s in stored.sources[:2]) and all(s.weight == 1 for s in stored.sources[2:])
    rehooked = json.loads(moeplug(home, "hook", "list", "--json").stdout)
    assert rehooked["hooks"][0]["updated"] > hooked["hooks"][0]["updated"]
    log = (Path(home["XDG_STATE_HOME"]) / "moeplug" / "reprofile.log").read_text().splitlines()
    assert len(log) == 1 and "exit 0: demo: re-planned" in log[0]

    # the human report names the drift and the way back
    new_bytes = profile.read_bytes()
    r = moeplug(home, "reprofile", "demo", "--rollback", "--apply", "never")
    assert r.returncode == 0, r.stderr
    assert profile.read_bytes() == old_bytes and Path(m["previous"]).read_bytes() == new_bytes
    assert installed(home)["plan"] == old_plan


@pytest_native
@pytest.mark.usefixtures("patched_build")
def test_traffic_like_the_bundled_prompts_is_nothing_to_do(home: dict[str, str]) -> None:
    profile = install_demo(home)
    before = {p.name: p.read_bytes() for p in profile.parent.iterdir()}
    record = (data(home) / "installed" / "demo.json").read_bytes()
    r = moeplug(home, "reprofile", "demo")
    assert r.returncode == 10, r.stderr[-3000:]
    assert "nothing to do" in r.stdout and "drift" in r.stdout
    assert {p.name: p.read_bytes() for p in profile.parent.iterdir()} == before  # nothing written, nothing kept
    assert (data(home) / "installed" / "demo.json").read_bytes() == record
    log = (Path(home["XDG_STATE_HOME"]) / "moeplug" / "reprofile.log").read_text()
    assert "exit 10: demo: nothing to do" in log
    r = moeplug(home, "reprofile", "demo", "--rollback")
    assert r.returncode == 1 and "no previous profile" in r.stderr and r.stderr.count("\n") == 1


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    env = xdg_homes(tmp_path, share_builds=False)
    for args, code, text in ((("reprofile",), 2, "name one installed model, or pass --all"),
                             (("reprofile", "demo", "--all"), 2, "or pass --all"),
                             (("reprofile", "nothing"), 1, "'nothing' is not installed"),
                             (("reprofile", "--all", "--apply", "later"), 2, "invalid choice"),
                             (("reprofile", "--all", "--half-life", "0"), 2, "--half-life")):
        r = moeplug(env, *args)
        assert r.returncode == code and r.stderr.count("\n") == 1 and text in r.stderr, (args, r)
    r = moeplug(env, "reprofile", "--all")
    assert r.returncode == 10 and "no installed model" in r.stdout


def lock_held(path: Path) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


@pytest_native
@pytest.mark.usefixtures("patched_build")
def test_a_concurrent_serve_waits_for_the_reprofile(home: dict[str, str], tmp_path: Path) -> None:
    """The re-profile is stopped while it holds the model's lock; `moeplug serve` waits for it, and
    serves the plan the re-profile left."""
    install_demo(home)
    record = data(home) / "installed" / "demo.json"
    doc = json.loads(record.read_text())
    doc["prompt_files"] = [str(numbers_prompts(tmp_path / "numbers.txt"))]  # the documented config key
    record.write_text(json.dumps(doc))
    lock = Path(home["XDG_STATE_HOME"]) / "moeplug" / "locks" / "demo.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()

    rp = subprocess.Popen([sys.executable, "-m", "moeplug", "reprofile", "demo", "--json"], env=home,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    serve = None
    try:
        while rp.poll() is None and not lock_held(lock):
            time.sleep(0.001)
        assert rp.poll() is None, rp.communicate()
        rp.send_signal(signal.SIGSTOP)
        assert lock_held(lock)  # stopped inside its locked section
        serve = subprocess.Popen([sys.executable, "-m", "moeplug", "serve", "demo", "--json"], env=home,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert serve.poll() is None  # waiting
        rp.send_signal(signal.SIGCONT)
        out, err = rp.communicate(timeout=300)
        assert rp.returncode == 0, err[-3000:]
        served_out, served_err = serve.communicate(timeout=300)
        assert serve.returncode == 0, served_err[-3000:]
        assert "waiting for another moeplug working on 'demo'" in served_err
        assert json.loads(served_out)["server"]["plan"] == installed(home)["plan"]  # the re-planned one
        assert json.loads(out)["models"][0]["plan_changed"]
    finally:
        if rp.poll() is None:
            rp.send_signal(signal.SIGCONT)
            rp.kill()
        if serve is not None and serve.poll() is None:
            serve.kill()
        moeplug(home, "stop", "--all")


def completions(url: str, n: int, done: list[float], errors: list[str]) -> None:
    for i in range(n):
        try:
            r = requests.post(f"{url}/completion", json={"prompt": f"def f{i}():", "n_predict": 64, "temperature": 0,
                                                          "cache_prompt": False, "ignore_eos": True}, timeout=120)
            if r.status_code != 200 or r.json()["tokens_predicted"] != 64:
                errors.append(f"{r.status_code} {r.text[:200]}")
        except requests.RequestException as exc:
            errors.append(str(exc))
        done.append(time.time())
        time.sleep(0.2)


@pytest_native
@pytest.mark.usefixtures("patched_build")
def test_a_restart_waits_until_no_request_is_in_flight(home: dict[str, str], tmp_path: Path) -> None:
    """--apply idle on a served model (rolled back here: no routing counts needed): requests 0.2 s
    apart keep it busy; the restart comes after the last one, each finished whole, same port."""
    install_demo(home)
    r = moeplug(home, "reprofile", "demo", "--prompt-file", str(numbers_prompts(tmp_path / "n.txt")), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    r = moeplug(home, "serve", "demo", "--no-record", "--json")  # the counters on by default, recording off
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout)["server"]
    try:
        done: list[float] = []
        errors: list[str] = []
        traffic = threading.Thread(target=completions, args=(first["url"], 12, done, errors))
        traffic.start()
        time.sleep(0.5)
        r = moeplug(home, "reprofile", "demo", "--rollback", "--apply", "idle", "--idle", "1", "--json")
        traffic.join()
        assert r.returncode == 0, r.stderr[-3000:]
        assert errors == [] and len(done) == 12
        doc = json.loads(r.stdout)["models"][0]
        assert doc["applied"] == "restarted"
        again = doc["server"]
        assert again["port"] == first["port"] and again["pid"] != first["pid"]
        assert again["started"] >= done[-1] + 0.8  # after the last request and a second of quiet
        assert "--metrics" in again["args"] and again["plan"] == installed(home)["plan"]
        assert requests.get(f"{again['url']}/health", timeout=5).json()["status"] == "ok"

        r = moeplug(home, "reprofile", "demo", "--rollback", "--apply", "never", "--json")
        assert json.loads(r.stdout)["models"][0]["applied"] == "never"
        r = moeplug(home, "reprofile", "demo")  # served --no-record: its routing is not counted
        assert r.returncode == 1 and "--moe-cache-record" in r.stderr and r.stderr.count("\n") == 1
    finally:
        moeplug(home, "stop", "--all")


# ---------------------------------------------------------------------------------------------
# the served path: llama-server --moe-cache-record (the native part; skipped until the build has it)


@pytest_native
def test_live_counts_from_a_recording_server(home: dict[str, str], patched_build) -> None:
    from moeplug.native.features import detect_features
    from moeplug.profile import model_fingerprint, read_profile

    if not detect_features(patched_build.binary("llama-server")).get("moe_cache_record"):
        pytest.skip("this build's llama-server has no --moe-cache-record yet")
    install_demo(home)
    r = moeplug(home, "serve", "demo", "--record", "--metrics", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout)["server"]
    try:
        assert "--moe-cache-record" in first["args"]
        rng = random.Random(9)
        for _ in range(6):
            prompt = " ".join(str(rng.randint(0, 99999)) for _ in range(60))
            requests.post(f"{first['url']}/completion", json={"prompt": prompt, "n_predict": 32, "temperature": 0,
                                                               "cache_prompt": False}, timeout=120).raise_for_status()
        page = requests.get(f"{first['url']}/metrics", timeout=5).text
        from moeplug.serving.monitor import parse_server_metrics

        metrics = parse_server_metrics(page)
        live = requests.get(f"{first['url']}/moe-cache/profile", timeout=30)
        assert live.status_code == 200
        path = Path(home["XDG_STATE_HOME"]) / "live.gguf"
        path.write_bytes(live.content)
        got = read_profile(path)
        got.check_model(model_fingerprint(installed(home)["path"]))
        assert [s.label for s in got.sources] == ["live"]
        assert got.tokens(0) >= 6 * 60 and got.tokens(1) >= 6 * 32  # at least the requests' tokens
        # a token whose logits are asked for counts as generated (native/README.md): each request's
        # last prompt token does, its last sampled token is never decoded; the warm-up run and the
        # launch's context probe add a few
        assert abs(got.tokens(1) - metrics.decode_tokens) <= 6 + 3

        r = moeplug(home, "reprofile", "demo", "--apply", "now", "--min-gain", "0", "--json")
        assert r.returncode in (0, 10), r.stderr[-3000:]
        doc = json.loads(r.stdout)["models"][0]
        assert doc["source"] == "live" and doc["tokens"] == {"prefill": got.tokens(0), "decode": got.tokens(1)}
        if doc["written"]:
            assert doc["applied"] == "restarted" and doc["server"]["port"] == first["port"]
            assert "--moe-cache-record" in doc["server"]["args"]
            assert read_profile(installed(home)["profile"]).sources[-1].label == "live"
        else:  # nothing stored: the server's counters were not reset, they keep counting
            path.write_bytes(requests.get(f"{first['url']}/moe-cache/profile", timeout=30).content)
            assert read_profile(path).tokens(1) >= got.tokens(1)
    finally:
        moeplug(home, "stop", "--all")


# ---------------------------------------------------------------------------------------------
# the workload: prompt lengths and generated tokens from the served model's log


def test_token_weighted_median_and_tolerance() -> None:
    from moeplug.serving.traffic import MIN_REQUESTS, Request, Traffic, learned_workload, weighted_median

    # half of all prompt tokens come in prompts of 4000 or more, though most requests are short
    assert weighted_median([4000, 4000, 100, 100, 100, 100, 100]) == 4000
    assert weighted_median([100] * 9 + [300]) == 100 and weighted_median([]) == 0
    t = Traffic.of([Request(4000, 50, 1.0, 1.0)] * 2 + [Request(100, 50, 1.0, 1.0)] * (MIN_REQUESTS - 2))
    assert t.prefill_weight == pytest.approx(8600 / 400) and t.planned_prompt_tokens == 4000
    assert learned_workload(t, 1.0, None) == (21.5, 4000)
    assert learned_workload(t, 20.0, 3500) is None  # within WORKLOAD_TOLERANCE of the plan: no churn
    assert learned_workload(Traffic.of([Request(4000, 50, 1.0, 1.0)] * (MIN_REQUESTS - 1)), 1.0, None) is None
    short = Traffic.of([Request(300, 30, 1.0, 1.0)] * MIN_REQUESTS)
    assert short.planned_prompt_tokens is None and learned_workload(short, 1.0, 4000) == (10.0, None)


def long_requests(url: str, lengths: list[int], n_predict: int) -> None:
    """Completions of token-id prompts of these lengths (ids the demo's vocabulary holds), no prompt cache."""
    rng = random.Random(11)
    n_vocab = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]["n_vocab"]
    for n in lengths:
        prompt = [rng.randint(10, n_vocab - 10) for _ in range(n)]
        r = requests.post(f"{url}/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                      "cache_prompt": False, "ignore_eos": True}, timeout=300)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["tokens_predicted"] == n_predict


@pytest_native
def test_the_plan_learns_the_prompts_the_server_sees(home: dict[str, str], patched_build) -> None:
    """A served model's log gives the prompt lengths and generated tokens of its requests (not the
    launch's own context probe); a weight set by hand is kept until --workload learn; the plan then
    keeps what it learned, says so, and a second run with nothing new is nothing to do."""
    from moeplug.native.features import detect_features

    if not detect_features(patched_build.binary("llama-server")).get("moe_cache_record"):
        pytest.skip("this build's llama-server has no --moe-cache-record yet")
    r = moeplug(home, "install", "demo", "--no-serve", "--ctx", "2048", "--prefill-weight", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    r = moeplug(home, "serve", "demo", "--record", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout)["server"]
    assert first["traffic_from"] > 0  # past the probe's request, which the log holds first
    try:
        long_requests(first["url"], [1200] * 10 + [40] * 2, n_predict=8)
        r = moeplug(home, "reprofile", "demo", "--min-gain", "1", "--json")
        assert r.returncode == 10, r.stderr[-3000:]
        doc = json.loads(r.stdout)["models"][0]
        traffic = doc["traffic"]
        assert traffic["requests"] == 12 and traffic["generated_tokens"] == 12 * 8
        assert traffic["prompt_median"] in (1200, 1201) and traffic["prompt_max"] in (1200, 1201)  # a BOS or not
        assert 10 * 1200 + 2 * 40 <= traffic["prompt_tokens"] <= 10 * 1201 + 2 * 41
        assert doc["workload"] is None and not doc["workload_stored"]
        assert any("set by hand" in n for n in doc["notes"])
        assert installed(home)["plan"]["prefill_weight"] == 3 and installed(home)["plan"]["workload"] is None
        # `moeplug status` reads the same log, incrementally
        r = moeplug(home, "status", "--json")
        assert json.loads(r.stdout)["servers"][0]["traffic"]["requests"] == 12, r.stderr
        assert "demo: served 12 requests" in moeplug(home, "status").stdout and "(set by hand)" in \
            moeplug(home, "status").stdout

        r = moeplug(home, "reprofile", "demo", "--min-gain", "1", "--workload", "learn", "--apply", "now", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout)["models"][0]
        weight = round(traffic["prompt_tokens"] / traffic["generated_tokens"], 3)
        assert doc["workload_stored"] and not doc["written"]  # the profile stays: --min-gain 1
        assert doc["workload"] == {"prefill_weight": weight, "prompt_tokens": traffic["prompt_median"]}
        assert doc["applied"] == "unchanged"  # a CPU plan: the same flags, the same server
        plan = installed(home)["plan"]
        assert plan["prefill_weight"] == weight and plan["prompt_tokens"] == traffic["prompt_median"]
        assert plan["workload"]["requests"] == 12
        text = moeplug(home, "plan", "demo").stdout
        assert "learned from 12 requests served" in text and f"{traffic['prompt_median']} tokens (learned)" in text
        assert "(learned from its traffic)" in moeplug(home, "status").stdout
        record = json.loads((Path(home["XDG_STATE_HOME"]) / "moeplug" / "servers" / "demo.json").read_text())
        assert record["pid"] == first["pid"] and requests.get(f"{first['url']}/health", timeout=5).ok  # not restarted
        log = (Path(home["XDG_STATE_HOME"]) / "moeplug" / "reprofile.log").read_text().splitlines()
        assert "workload learned: prefill weight" in log[-1]

        # the same traffic again: what the plan weighs already
        r = moeplug(home, "reprofile", "demo", "--min-gain", "1", "--json")
        assert r.returncode == 10, r.stderr[-3000:]
        assert json.loads(r.stdout)["models"][0]["workload"] is None
    finally:
        moeplug(home, "stop", "--all")


@pytest_native
@pytest.mark.usefixtures("patched_build")
def test_served_without_record_the_workload_alone(home: dict[str, str]) -> None:
    """With --no-record the routing is not counted, but the log still tells the workload: a re-profile
    plans for it; once it has, there is nothing to learn and the error says to serve it recording."""
    r = moeplug(home, "install", "demo", "--no-serve", "--ctx", "2048")
    assert r.returncode == 0, r.stderr[-3000:]
    profile = Path(installed(home)["profile"])
    before = profile.read_bytes()
    r = moeplug(home, "serve", "demo", "--no-record", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads(r.stdout)["server"]
    try:
        long_requests(first["url"], [900] * 8, n_predict=10)
        r = moeplug(home, "reprofile", "demo", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout)["models"][0]
        assert doc["source"] == "log" and doc["layers"] == [] and not doc["written"] and doc["workload_stored"]
        assert doc["traffic"]["requests"] == 8 and doc["workload"]["prompt_tokens"] in (900, 901)
        assert doc["applied"] == "unchanged" and any("--no-record" in n for n in doc["notes"])
        assert profile.read_bytes() == before  # the profile is the routing's: untouched
        plan = installed(home)["plan"]
        assert plan["workload"]["requests"] == 8 and plan["prompt_tokens"] == doc["workload"]["prompt_tokens"]
        # more, shorter requests: fewer prompt tokens per generated token, the people's report
        long_requests(first["url"], [100] * 16, n_predict=10)
        r = moeplug(home, "reprofile", "demo")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "the server's log, its routing not counted" in r.stdout and "traffic served: 24 requests" in r.stdout
        assert "not restarted: it runs the new plan's flags already" in r.stdout
        assert installed(home)["plan"]["prefill_weight"] == pytest.approx((8 * 900 + 16 * 100) / 240, abs=0.2)
        again = moeplug(home, "reprofile", "demo")  # nothing new to learn: what would count the routing
        assert again.returncode == 1 and "--moe-cache-record" in again.stderr and again.stderr.count("\n") == 1
    finally:
        moeplug(home, "stop", "--all")
