"""Ollama: swap moeplug's patched llama-server in for the one Ollama bundles, and keep a plan file
beside every installed model's profile so that one setting serves every model Ollama loads.

What this relies on, read from Ollama's source (ollama/ollama, not copied):
- `llm/llama_server_binary.go` (llamaCppBinaryCandidates): Ollama runs `llama-server` from its
  `lib/ollama` folder: on Linux `<dir of the resolved ollama executable>/../lib/ollama`, elsewhere
  also `<dir>/lib/ollama`.
- `llm/llama_server.go` (startLlamaServer, SetupLlamaServerCommandEnv): argv `--model BLOB --port P
  --host 127.0.0.1 --no-webui --offline -c N -np N --log-verbosity 4 --no-log-prefix
  --no-log-timestamps --flash-attn on|off|auto`, and when set `-ngl`, `-t`, `-b`/`-ub`,
  `--cache-type-k/-v`, `--load-mode`, `--mmproj`, `--lora`, `--spec-*`, `--context-shift --keep`,
  `--split-mode --main-gpu`, `--no-jinja --chat-template`; env: Ollama's own environment plus
  `LD_LIBRARY_PATH` (llama-server's folder first), `LLAMA_MEDIA_MARKER`, `GGML_BACKEND_PATH` (a GPU
  variant's backend library) and `LLAMA_ARG_FIT_TARGET` (for projector models, unless inherited).
  So `LLAMA_ARG_MOE_CACHE_*` set on `ollama serve` reach every llama-server it starts; and so does
  `LLAMA_ARG_RPC` (llama.cpp's variable for `--rpc`, which Ollama does not pass), the remote devices
  (machine.rpc) of the installed plans: one list for every model, as the environment is every
  runner's (`rpc_environment`).

The swap backs up every file it replaces (bytes, mode, links) under moeplug's state folder and
restores them exactly; the swapped binary is recognised by its sha256, so an Ollama update that
replaced it shows in `moeplug hook list` and is re-applied (or warned about) by `hook watch`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from moeplug.core.errors import MoeplugError
from moeplug.core.fsutil import atomic_path, sha256_file, write_text_atomic
from moeplug.hooks import plan_files
from moeplug.hooks.installed import Installed, flag_pairs
from moeplug.core.paths import state_dir
from moeplug.core.progress import Note, ProgressFn, silent

SERVER = "llama-server"
# The flags and variables Ollama's startLlamaServer can pass (llm/llama_server.go), for when the
# ollama executable is not at hand to read them from.
OLLAMA_FLAGS = ("--model", "--port", "--host", "--no-webui", "--offline", "-c", "-np", "--log-verbosity",
                "--no-log-prefix", "--no-log-timestamps", "--no-jinja", "--chat-template", "--mmproj",
                "--no-mmproj-offload", "--spec-type", "--spec-draft-n-max", "--spec-draft-backend-sampling",
                "--no-spec-draft-backend-sampling", "--spec-draft-model", "--image-min-tokens", "--lora",
                "--load-mode", "--cache-type-k", "--cache-type-v", "--flash-attn", "--embedding", "-b", "-ub",
                "-ngl", "-t", "--split-mode", "--main-gpu", "--context-shift", "--keep")
OLLAMA_VARS = ("LLAMA_ARG_FIT_TARGET",)
DROPIN_NAME = "moeplug.conf"
_FLAG = re.compile(r"(?:^|[\s,])(--?[A-Za-z][A-Za-z0-9-]*)")
_VAR = re.compile(r"LLAMA_ARG_[A-Z0-9_]+")


@dataclass(frozen=True)
class OllamaInstall:
    lib_dir: Path  # the folder whose llama-server Ollama runs
    executable: Path | None  # the ollama program, when found


def find_install(ollama_dir: Path | None = None) -> OllamaInstall:
    """Ollama's lib/ollama: from --ollama-dir (the install prefix, or lib/ollama itself), else from
    `ollama` on PATH as Ollama itself looks (llamaCppBinaryCandidates)."""
    if ollama_dir is not None:
        d = ollama_dir.expanduser().absolute()
        for lib, exes in ((d, (d.parent.parent / "bin" / "ollama", d.parent.parent / "ollama")),
                          (d / "lib" / "ollama", (d / "bin" / "ollama", d / "ollama"))):
            if (lib / SERVER).is_file():
                return OllamaInstall(lib, next((e for e in exes if e.is_file()), None))
        raise MoeplugError(f"ollama: no {SERVER} in {d} or {d / 'lib' / 'ollama'} (give Ollama's install "
                           f"folder, e.g. /usr/local, or its lib/ollama)")
    found = shutil.which("ollama")
    if not found:
        raise MoeplugError("ollama: 'ollama' is not on PATH; give its install folder with --ollama-dir DIR")
    exe = Path(found).resolve()
    for lib in (exe.parent.parent / "lib" / "ollama", exe.parent / "lib" / "ollama"):
        if (lib / SERVER).is_file():
            return OllamaInstall(lib, exe)
    raise MoeplugError(f"ollama: {exe} has no {SERVER} in ../lib/ollama or lib/ollama: an Ollama older than its "
                       f"llama-server runner? (give --ollama-dir DIR)")


@dataclass(frozen=True)
class ServerInfo:
    version: str
    flags: frozenset[str]
    variables: frozenset[str]


def server_info(binary: Path, lib_dirs: Sequence[Path]) -> ServerInfo:
    """A llama-server's version line and the flags and LLAMA_ARG_* variables its --help lists, run
    with these folders on LD_LIBRARY_PATH, as Ollama runs it with its own."""
    paths = [str(d) for d in lib_dirs] + [os.environ.get("LD_LIBRARY_PATH", "")]
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, paths)))
    out = {}
    for arg in ("--version", "--help"):
        try:
            r = subprocess.run([str(binary), arg], capture_output=True, text=True, env=env, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MoeplugError(f"ollama: cannot run {binary} {arg}: {exc}") from None
        out[arg] = r.stdout + r.stderr
    if "--model" not in out["--help"]:
        raise MoeplugError(f"ollama: {binary} --help lists no --model: not a llama-server")
    version = next((ln.strip() for ln in out["--version"].splitlines() if ln.strip().startswith("version")), "unknown")
    return ServerInfo(version, frozenset(_FLAG.findall(out["--help"])), frozenset(_VAR.findall(out["--help"])))


def passed_by_ollama(bundled: ServerInfo, executable: Path | None) -> tuple[set[str], set[str]]:
    """The flags and variables of the bundled llama-server that Ollama may pass: those its program
    names (read from the executable's bytes), else the ones its source passes (OLLAMA_FLAGS)."""
    flags, variables = set(OLLAMA_FLAGS), set(OLLAMA_VARS)
    if executable is not None:
        data = executable.read_bytes()
        flags |= {f for f in bundled.flags if re.search(re.escape(f.encode()) + rb"(?![A-Za-z0-9-])", data)}
        variables |= {v.decode() for v in set(re.findall(rb"LLAMA_ARG_[A-Z0-9_]+", data))}
    return flags & bundled.flags, variables & bundled.variables


def check_compatible(ours: ServerInfo, bundled: ServerInfo, executable: Path | None) -> None:
    flags, variables = passed_by_ollama(bundled, executable)
    missing = sorted(flags - ours.flags) + sorted(variables - ours.variables)
    if missing:
        raise MoeplugError(f"ollama: moeplug's llama-server does not accept {', '.join(missing)}, which Ollama passes "
                           f"to its bundled llama-server ({bundled.version}): nothing changed")


# ---------------------------------------------------------------------------------------------
# the swap: back up, install atomically, restore


def backup_dir(lib_dir: Path) -> Path:
    return state_dir() / "ollama-backup" / hashlib.sha256(str(lib_dir).encode()).hexdigest()[:16]


def _ours(bin_dir: Path) -> list[Path]:
    """What goes into lib/ollama: llama-server and the shared libraries beside it (links as links)."""
    return sorted(p for p in bin_dir.iterdir() if p.name == SERVER or ".so" in p.name)


def _entry(path: Path) -> dict[str, object]:
    if path.is_symlink():
        return {"kind": "link", "target": os.readlink(path)}
    if path.is_file():
        return {"kind": "file", "sha256": sha256_file(path), "mode": path.stat().st_mode & 0o7777}
    return {"kind": "absent"}


def _put(src_entry: dict[str, object], dest: Path, data_from: Path | None) -> None:
    """Make dest what src_entry describes (a link, a file copied from data_from, or nothing), atomically."""
    if src_entry["kind"] == "absent":
        dest.unlink(missing_ok=True)
        return
    with atomic_path(dest) as tmp:
        tmp.unlink()
        if src_entry["kind"] == "link":
            os.symlink(str(src_entry["target"]), tmp)
        else:
            assert data_from is not None
            shutil.copyfile(data_from, tmp)
            os.chmod(tmp, int(str(src_entry["mode"])))


def manifest_path(lib_dir: Path) -> Path:
    return backup_dir(lib_dir) / "manifest.json"


def read_manifest(lib_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads(manifest_path(lib_dir).read_text())
    except (OSError, ValueError):
        return None


def check_writable(lib_dir: Path) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".moeplug-write-check.", dir=lib_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise MoeplugError(f"ollama: cannot write {lib_dir} ({exc.strerror}; run as its owner, e.g. with sudo): "
                           f"nothing changed") from None


def swap_in(install: OllamaInstall, bin_dir: Path, build_id: str, progress: ProgressFn = silent) -> dict[str, object]:
    """Back up the bundled files moeplug's replace (first time only), then install moeplug's
    llama-server and libraries into lib/ollama, each file atomically, the binary last."""
    lib = install.lib_dir
    old = read_manifest(lib)
    ours = _ours(bin_dir)
    bdir = backup_dir(lib)
    bdir.mkdir(parents=True, exist_ok=True)
    originals: dict[str, object] = {}
    if old is not None:  # keep the first backup of every file still as moeplug installed it
        installed: dict[str, str | None] = old["installed"]  # type: ignore[assignment]
        originals = {name: entry for name, entry in old["originals"].items()  # type: ignore[union-attr]
                     if _entry(lib / name).get("sha256") == installed.get(name)}
    for p in ours:
        if p.name not in originals:  # first time, or Ollama put a new one there since
            entry = _entry(lib / p.name)
            # the backup as it was, its mode and links too: a second 'hook ollama' runs it to read its flags,
            # on its own libraries (found through its links beside it)
            if entry["kind"] == "file":
                shutil.copyfile(lib / p.name, bdir / p.name)
                os.chmod(bdir / p.name, int(str(entry["mode"])))
            elif entry["kind"] == "link":
                (bdir / p.name).unlink(missing_ok=True)
                os.symlink(str(entry["target"]), bdir / p.name)
            originals[p.name] = entry
    for p in sorted(ours, key=lambda p: p.name == SERVER):
        _put(_entry(p), lib / p.name, p)
    manifest = {"lib_dir": str(lib), "build_id": build_id, "originals": originals,
                "installed": {p.name: _entry(lib / p.name).get("sha256") for p in ours}}
    write_text_atomic(manifest_path(lib), json.dumps(manifest, indent=2) + "\n")
    progress(Note(f"ollama: moeplug's llama-server ({build_id}) installed in {lib}; the bundled files are kept in {bdir}"))
    return manifest


def binary_state(lib_dir: Path) -> str:
    """'swapped' (moeplug's binary is in place), 'replaced' (Ollama put another there since), 'missing'."""
    m = read_manifest(lib_dir)
    if m is None or not (lib_dir / SERVER).is_file():
        return "missing"
    return "swapped" if sha256_file(lib_dir / SERVER) == m["installed"].get(SERVER) else "replaced"  # type: ignore[union-attr]


def restore(lib_dir: Path) -> list[str]:
    """Put back the bundled files exactly (checked by sha256); files Ollama replaced since are left
    as Ollama put them. Returns notes on what was left."""
    m = read_manifest(lib_dir)
    if m is None:
        return [f"no backup of {lib_dir}: nothing to restore"]
    bdir, notes = backup_dir(lib_dir), []
    installed: dict[str, str | None] = m["installed"]  # type: ignore[assignment]
    for name, entry in sorted(m["originals"].items()):  # type: ignore[union-attr]
        dest = lib_dir / name
        now = _entry(dest)
        if now.get("sha256") != installed.get(name) and now["kind"] == "file":
            notes.append(f"{dest} was replaced since (an Ollama update?): left as it is")
            continue
        _put(entry, dest, bdir / name)
        if entry["kind"] == "file" and sha256_file(dest) != entry["sha256"]:
            raise MoeplugError(f"ollama: {dest} does not match its backup after restoring (sha256); the backup is "
                               f"kept in {bdir}")
    shutil.rmtree(bdir, ignore_errors=True)
    return notes


# ---------------------------------------------------------------------------------------------
# the environment: a systemd drop-in for ollama.service, or lines for the shell


def environment(models: Sequence[Installed] = ()) -> dict[str, str]:
    """What `ollama serve` needs, the same for every model: each model finds its profile in moeplug's
    store and, beside it, its plan file (plan_files.plan_text): its own plan's slots and settings, or stock's
    placement where its check chose that, so that no choice of one model's plan is every model's; a
    model without a profile there runs as Ollama ran it. And the installed models' remote devices
    (rpc_environment)."""
    return {"LLAMA_ARG_MOE_CACHE_PROFILE": str(plan_files.profiles_dir()), "LLAMA_ARG_MOE_CACHE_SLOTS": "auto",
            **rpc_environment(models)[0]}


RPC_VAR = "LLAMA_ARG_RPC"  # llama.cpp's environment variable for --rpc (common/arg.cpp)


def rpc_environment(models: Sequence[Installed]) -> tuple[dict[str, str], str | None]:
    """The remote devices the installed models' plans run on, as Ollama's runners can be given them,
    and a note for people: LLAMA_ARG_RPC with the --rpc list the plans share (every model Ollama starts
    adds those devices, since `ollama serve`'s environment is every runner's; Ollama places the layers,
    not the plan's --tensor-split), and OLLAMA_MAX_LOADED_MODELS=1 beside it (an rpc-server serves one
    client at a time: a second runner would wait for the first at its start). Where the plans name
    different lists, one environment cannot hold them: none, and the note says so. A model served with
    stock's placement (the install's check) runs without its remote devices, as under `moeplug serve`."""
    lists = {m.name: dict(flag_pairs(m.plan.server_args)).get("--rpc") for m in models if m.placement != "stock"}
    lists = {name: value for name, value in lists.items() if value}
    if not lists:
        return {}, None
    if len(set(lists.values())) > 1:
        named = "; ".join(f"{name}: {value}" for name, value in sorted(lists.items()))
        return {}, (f"the installed plans name different remote devices ({named}): Ollama's environment is every "
                    f"model's and holds one --rpc list, so it holds none; plan them with the same --rpc")
    value, plans = next(iter(lists.values())), f"plan{'s' if len(lists) > 1 else ''} of {', '.join(sorted(lists))}"
    return {RPC_VAR: value, "OLLAMA_MAX_LOADED_MODELS": "1"}, (
        f"{RPC_VAR}={value} (the {plans}): every model Ollama starts adds these remote devices, one model loaded "
        f"at a time (OLLAMA_MAX_LOADED_MODELS=1: an rpc-server serves one client at a time)")


def systemd_dirs() -> list[Path]:
    if os.environ.get("MOEPLUG_SYSTEMD_DIR"):  # tests: a folder standing for /etc/systemd/system
        return [Path(os.environ["MOEPLUG_SYSTEMD_DIR"])]
    return [Path("/etc/systemd/system"), Path("/lib/systemd/system"), Path("/usr/lib/systemd/system")]


def dropin_path() -> Path | None:
    """ollama.service's drop-in file, when the unit exists."""
    dirs = systemd_dirs()
    if any((d / "ollama.service").exists() for d in dirs):
        return dirs[0] / "ollama.service.d" / DROPIN_NAME
    return None


def dropin_text(env: dict[str, str]) -> str:
    return "\n".join([f"{plan_files.HEADER} ('moeplug hook ollama'); 'moeplug hook remove ollama' removes it", "[Service]",
                      *(f"Environment={k}={v}" for k, v in env.items()), ""])


def write_environment(models: Sequence[Installed] = ()) -> tuple[Path | None, str]:
    """The drop-in written (path) and what to do next, or (None, the shell lines); the remote
    devices' note (rpc_environment) after either."""
    env = environment(models)
    note = rpc_environment(models)[1]
    after = f"\nremote devices: {note}" if note else ""
    path = dropin_path()
    if path is None:
        lines = "\n".join(f"export {k}={v}" for k, v in env.items())
        return None, f"no ollama.service here: set these where 'ollama serve' runs, then restart it:\n{lines}{after}"
    write_text_atomic(path, dropin_text(env))
    return path, f"wrote {path}; run: systemctl daemon-reload && systemctl restart ollama{after}"


def refresh_environment(models: Sequence[Installed]) -> bool:
    """Bring moeplug's drop-in up to date with the installed models (their remote devices); True when
    it changed (Ollama reads it at its next restart). Without one (no ollama.service: the shell lines)
    nothing is written: 'moeplug hook ollama' prints the lines again."""
    path = dropin_path()
    if path is None or not path.exists() or not path.read_text().startswith(plan_files.HEADER):
        return False
    text = dropin_text(environment(models))
    if path.read_text() == text:
        return False
    write_text_atomic(path, text)
    return True


def remove_environment() -> None:
    path = dropin_path()
    if path is not None and path.exists() and path.read_text().startswith(plan_files.HEADER):
        path.unlink()
