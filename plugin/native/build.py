"""Build llama.cpp (stock or patched; CPU, CUDA or Vulkan) offline and install it under a build id.

    builds/<build-id>/bin/llama-server ...   programs and their shared libraries
    builds/<build-id>/build.json             what was built, from what, and what it supports

The id hashes the lock, the patches, the overlay and the options, so building the same id again
is a no-op and any change gives a new id.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeplug.core.errors import BuildError, MoeplugError
from moeplug.machine.backend import Backend, backend as backend_of
from moeplug.core.fsutil import atomic_dir, write_text_atomic
from moeplug.native.cpu_probe import native_cpu_flags
from moeplug.native.features import detect_features
from moeplug.native.lock import NativeSpec, load_spec
from moeplug.native.source import prepare_tree, source_origin
from moeplug.core.paths import builds_dir, cache_dir, logs_dir
from moeplug.core.progress import Note, ProgressFn, Step, silent
from moeplug.core.runlog import run_logged

# The programs moeplug runs. The patched build adds our router profiler and our native tests;
# the stock build adds llama-eval-callback, the independent route the profiler's recorded ids
# are checked against.
TARGETS = ("llama-server", "llama-cli", "llama-bench", "ggml-rpc-server")
PATCHED_TARGETS = (
    *TARGETS, "llama-moe-profile", "llama-eval-callback", "test-moe-split", "test-moe-cache", "test-llama-archs",
    "llama-fit-params",
)
STOCK_TARGETS = (*TARGETS, "llama-eval-callback")
# A Vulkan build compiles its shaders (most of its time on 2 cores), so it builds what installing, serving and
# its tests run: the profiler, llama.cpp's own estimate of the GPU's buffers, the bitwise test and the op tests
# (test-backend-ops: the shaders' negative expert ids against the CPU); the stock one what a benchmark's
# stock side runs
VULKAN_TARGETS = (*TARGETS, "llama-moe-profile", "llama-fit-params", "test-moe-cache", "test-backend-ops")
VULKAN_STOCK_TARGETS = TARGETS
# A sanitized build (--sanitize) has only what the hostile-file tests run: the server, which reads
# profiles and models, and in a patched build the profiler that writes the profiles.
SANITIZE_TARGETS = ("llama-server",)
PATCHED_SANITIZE_TARGETS = (*SANITIZE_TARGETS, "llama-moe-profile")

OFFLINE_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",  # configured, not built: only the targets below are (eval-callback)
    "-DLLAMA_BUILD_TESTS=ON",  # configured, not built: only the targets below are (test-moe-split)
    "-DLLAMA_BUILD_APP=OFF",
    # programs find their shared libraries beside them, so the bin/ folder can be moved
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
)

# llama.cpp's RPC backend compiled in (llama-server --rpc HOST:PORT adds remote devices) and its
# ggml-rpc-server, which serves a machine's devices to another's llama-server (serving.rpc_server); the
# sanitized builds, which serve no remote device, go without
RPC_CMAKE_FLAGS = ("-DGGML_RPC=ON",)

# AddressSanitizer and UndefinedBehaviorSanitizer through llama.cpp's own options (ggml's and
# llama's: each covers its own libraries), at -O1 with line tables so that 2 cores build it in
# reasonable time and reports name file and line; NDEBUG as in Release, so that every check that
# runs is the one the normal build runs.
SANITIZE_CMAKE_FLAGS = (
    "-DLLAMA_SANITIZE_ADDRESS=ON",
    "-DLLAMA_SANITIZE_UNDEFINED=ON",
    "-DGGML_SANITIZE_ADDRESS=ON",
    "-DGGML_SANITIZE_UNDEFINED=ON",
    "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
    "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG",
)
SANITIZE_SUFFIX = "-asan"

MANIFEST = "build.json"


@dataclass(frozen=True)
class BuildOptions:
    backend: Backend
    stock: bool = False
    cuda_arch: str | None = None
    jobs: int = 0  # 0: one per core
    targets: tuple[str, ...] = ()  # default: PATCHED_TARGETS or STOCK_TARGETS
    cpu_flags: tuple[str, ...] = field(default_factory=tuple)
    sanitize: bool = False  # ASan + UBSan (SANITIZE_CMAKE_FLAGS), CPU only

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", backend_of(self.backend))
        if not self.targets:
            if self.sanitize:
                targets = SANITIZE_TARGETS if self.stock else PATCHED_SANITIZE_TARGETS
            elif self.backend is Backend.VULKAN:
                targets = VULKAN_STOCK_TARGETS if self.stock else VULKAN_TARGETS
            else:
                targets = STOCK_TARGETS if self.stock else PATCHED_TARGETS
            object.__setattr__(self, "targets", targets)

    def identity(self) -> dict[str, Any]:
        """What changes the produced binaries (jobs does not). A build without sanitizers has no
        "sanitize" key, so its id is the one it had before sanitized builds existed."""
        ident: dict[str, Any] = {"backend": self.backend.value, "stock": self.stock, "cuda_arch": self.cuda_arch,
                                 "targets": list(self.targets), "cpu_flags": list(self.cpu_flags)}
        if self.sanitize:
            ident["sanitize"] = list(SANITIZE_CMAKE_FLAGS)
        return ident


@dataclass
class BuildResult:
    build_id: str
    path: Path
    manifest: dict[str, Any]
    built: bool  # False when it was already installed

    @property
    def bin_dir(self) -> Path:
        return self.path / "bin"

    @property
    def backend(self) -> Backend:
        """The backend it was built for (its manifest's; a manifest without one: the CPU)."""
        return backend_of(self.manifest.get("backend"))

    def binary(self, name: str) -> Path:
        return self.bin_dir / name


def build_id(spec: NativeSpec, opts: BuildOptions, origin: str | None = None) -> str:
    h = hashlib.sha256()
    h.update(spec.digest(opts.stock).encode())
    h.update(json.dumps(opts.identity(), sort_keys=True).encode())
    h.update((origin or source_origin()).encode())
    # the build number and commit compiled in (a build made before they were set says b0-unknown: made again)
    h.update(json.dumps(build_info(spec, opts.stock, origin)).encode())
    kind = "stock" if opts.stock else "moeplug"
    return f"{spec.lock.tag}-{opts.backend.value}-{kind}-{h.hexdigest()[:12]}{SANITIZE_SUFFIX if opts.sanitize else ''}"


def build_info(spec: NativeSpec, stock: bool, origin: str | None = None) -> tuple[int, str]:
    """llama.cpp's build number and commit for a build from `spec` (LLAMA_BUILD_NUMBER and
    LLAMA_BUILD_COMMIT: llama.cpp's cmake/build-info.cmake asks git for them, and a release source
    without .git gives 0 and "unknown"). What llama-server reports as `system_fingerprint`,
    "b{number}-{commit}", then names the build: the tag's number (b11434: 11434), and for the commit
    the source (the locked sdist: "sdist.SHA8" of its SHA-256, as no upstream commit comes with it; a
    local tree: its git HEAD, or "local") and, for a patched build, "-moeplug.DIGEST8", the patch
    series' and overlay's hash (the same as tree_id's)."""
    m = re.fullmatch(r"b(\d+)", spec.lock.tag)
    number = int(m[1]) if m else 0
    origin = origin or source_origin()
    if origin == "sdist":
        source = f"sdist.{spec.lock.sha256[:8]}"
    else:
        source = "local"
        local = Path(origin.removeprefix("local:"))
        if (local / ".git").exists() and shutil.which("git"):
            import subprocess

            r = subprocess.run(["git", "-C", str(local), "rev-parse", "--short=8", "HEAD"], capture_output=True,
                               text=True, timeout=30)
            source = r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else source
    return number, source if stock else f"{source}-moeplug.{spec.digest(stock)[:8]}"


def tree_id(spec: NativeSpec, stock: bool, origin: str | None = None) -> str:
    """The id of the prepared source tree (stock, or with this patch series and overlay), from
    the sdist or, with its own id, from a local tree."""
    origin = origin or source_origin()
    local = "" if origin == "sdist" else f"-local-{hashlib.sha256(origin.encode()).hexdigest()[:8]}"
    return f"{spec.lock.tag}-{spec.digest(stock)[:16]}{local}"


def detect_gpu_arch() -> str | None:
    """The first NVIDIA GPU's compute capability as a CMake architecture ("90"), or None."""
    from moeplug.machine.gpu import gpu_arch

    return gpu_arch()


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None
    )


def resolve_options(backend: str | Backend | None, stock: bool, jobs: int, cuda_arch: str | None,
                    sanitize: bool = False) -> BuildOptions:
    """Pick the backend: CUDA when nvcc and a GPU are present (or forced), Vulkan when asked (its
    headers and glslc checked here: one line naming the packages), else CPU; a sanitized build is a
    CPU build."""
    from moeplug.native import vulkan

    asked = None if backend is None else backend_of(backend)
    if sanitize:
        if asked is not None and asked.gpu:
            raise MoeplugError(f"--sanitize: sanitized builds are CPU builds (drop --{asked.value})")
        asked = Backend.CPU
    gpu_arch = detect_gpu_arch() if asked in (None, Backend.CUDA) else None  # no NVML probe for another build
    if asked is None:
        asked = Backend.CUDA if find_nvcc() and gpu_arch else Backend.CPU
    if asked is Backend.CUDA:
        if not find_nvcc():
            raise MoeplugError("--cuda: nvcc not found (install the CUDA toolkit or put nvcc on PATH)")
        cuda_arch = cuda_arch or gpu_arch
        if not cuda_arch:
            raise MoeplugError("--cuda: no GPU to read the compute capability from; pass --cuda-arch (e.g. 90)")
    else:
        cuda_arch = None
    if asked is Backend.VULKAN and vulkan.missing():
        raise MoeplugError(vulkan.missing_message(vulkan.missing()))
    return BuildOptions(backend=asked, stock=stock, cuda_arch=cuda_arch, jobs=jobs, cpu_flags=native_cpu_flags(),
                        sanitize=sanitize)


def cmake_args(opts: BuildOptions, tree: Path, build_dir: Path, info: tuple[int, str] | None = None) -> list[str]:
    """The configure command; info: the build number and commit to compile in (build_info)."""
    args = ["cmake", "-S", str(tree), "-B", str(build_dir), *OFFLINE_CMAKE_FLAGS]
    if info is not None:
        args += [f"-DLLAMA_BUILD_NUMBER={info[0]}", f"-DLLAMA_BUILD_COMMIT={info[1]}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if opts.cpu_flags:
        flags = " ".join(opts.cpu_flags)
        args += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    if opts.sanitize:
        args += SANITIZE_CMAKE_FLAGS  # after OFFLINE_CMAKE_FLAGS: its build type wins
    else:
        args += RPC_CMAKE_FLAGS
    if opts.backend is Backend.VULKAN:
        args.append("-DGGML_VULKAN=ON")
    if opts.backend is Backend.CUDA:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={opts.cuda_arch}"]
        nvcc = find_nvcc()
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    return args


_STEP_RE = re.compile(r"^\[(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def _run_step(cmd: list[str], log: Path, what: str, progress: ProgressFn) -> None:
    """Run a build step into the log; its [n/N] or [p%] lines become Steps of the task `what`."""
    def on_line(line: str) -> None:
        m = _STEP_RE.match(line)
        if m:
            done, total = (int(m[1]), int(m[2])) if m[1] else (int(m[3]), 100)
            progress(Step(what, done, total, "step"))

    run_logged(cmd, log, what, on_line=on_line, append=True, error=BuildError)


def _install(build_dir: Path, dest: Path, opts: BuildOptions) -> None:
    """Copy the targets and every shared library they use into dest/bin."""
    src_bin = build_dir / "bin"
    (dest / "bin").mkdir(parents=True)
    for entry in sorted(src_bin.iterdir()):
        if entry.name in opts.targets or ".so" in entry.name:
            shutil.copy2(entry, dest / "bin" / entry.name, follow_symlinks=False)
    missing = [t for t in opts.targets if not (dest / "bin" / t).exists()]
    if missing:
        raise BuildError(f"the build produced no {', '.join(missing)}")


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


@contextmanager
def _build_lock(bid: str) -> Iterator[None]:
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{bid}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(opts: BuildOptions, spec: NativeSpec | None = None, progress: ProgressFn = silent) -> BuildResult:
    """Build and install `opts`, or return the installed build with the same id."""
    spec = spec or load_spec()
    bid = build_id(spec, opts)
    dest = builds_dir() / bid
    with _build_lock(bid):
        manifest = read_manifest(dest)
        if manifest is not None:
            return BuildResult(bid, dest, manifest, built=False)
        logs_dir().mkdir(parents=True, exist_ok=True)
        log = logs_dir() / f"native-build-{bid}.log"
        log.write_text(f"moeplug native build {bid}\n{json.dumps(opts.identity())}\n")
        started = time.time()
        kind = "stock" if opts.stock else f"patched ({len(spec.patches)} patches)"
        kind += ", ASan+UBSan" if opts.sanitize else ""
        progress(Note(f"native build {bid}: llama.cpp {spec.lock.tag}, {opts.backend}, {kind}; log: {log}"))
        tree = prepare_tree(spec, opts.stock, tree_id(spec, opts.stock), log)
        build_dir = cache_dir() / "build" / bid
        _run_step(cmake_args(opts, tree, build_dir, build_info(spec, opts.stock)), log, "configure", progress)
        jobs = opts.jobs or os.cpu_count() or 2
        _run_step(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *opts.targets], log, "build",
                  progress)
        with atomic_dir(dest) as tmp:
            _install(build_dir, tmp, opts)
            manifest = {
                "build_id": bid,
                "llama_cpp_tag": spec.lock.tag,
                "build_info": "b{}-{}".format(*build_info(spec, opts.stock)),  # llama-server's system_fingerprint
                "backend": opts.backend.value,
                "stock": opts.stock,
                "cuda_arch": opts.cuda_arch,
                "cpu_flags": list(opts.cpu_flags),
                "sanitize": opts.sanitize,
                "targets": list(opts.targets),
                "patches": [] if opts.stock else [p.name for p in spec.patches],
                "source": source_origin(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.time() - started, 1),
                # the server's flags; a build of other targets only (the benchmark's) has none to read
                "features": detect_features(tmp / "bin" / "llama-server") if "llama-server" in opts.targets else {},
            }
            write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        progress(Note(f"installed {dest} in {manifest['build_seconds']:.0f} s"))
        return BuildResult(bid, dest, manifest, built=True)


def installed_builds() -> list[BuildResult]:
    root = builds_dir()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.iterdir()):
        manifest = read_manifest(path)
        if manifest is not None and not path.name.startswith("."):
            out.append(BuildResult(path.name, path, manifest, built=False))
    return out


def is_current(result: BuildResult, spec: NativeSpec | None = None) -> bool:
    """True when this checkout would build the same id with the build's own options: the build
    has the current lock, patch series and overlay."""
    m = result.manifest
    try:
        opts = BuildOptions(backend=m["backend"], stock=m["stock"], cuda_arch=m.get("cuda_arch"),
                            targets=tuple(m["targets"]), cpu_flags=tuple(m.get("cpu_flags", [])),
                            sanitize=bool(m.get("sanitize", False)))
    except (KeyError, TypeError):
        return False
    return build_id(spec or load_spec(), opts, m.get("source", "sdist")) == result.build_id


def prune(spec: NativeSpec | None = None, dry_run: bool = False) -> list[Path]:
    """Remove stale builds (with their build folders) and source trees that no current build uses."""
    spec = spec or load_spec()
    doomed: list[Path] = []
    for b in installed_builds():
        if not is_current(b, spec):
            doomed += [b.path, cache_dir() / "build" / b.build_id]
    keep_trees = {tree_id(spec, stock, origin) for stock in (True, False) for origin in {"sdist", source_origin()}}
    src = cache_dir() / "src"
    if src.is_dir():
        doomed += [t for t in sorted(src.iterdir()) if t.name not in keep_trees]
    doomed = [p for p in doomed if p.exists()]
    if not dry_run:
        for path in doomed:
            shutil.rmtree(path)
    return doomed
