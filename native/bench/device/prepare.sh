#!/usr/bin/env bash
# Run on the development machine before a run's first device call: fills the two git-ignored
# folders the calls carry (`run` with carry [".carry", ".whl"]), which a new checkout does not have.
#   .whl    wheels (CPython 3.12, x86-64) of what moeplug and its tests need beyond the device image's
#           PyTorch environment, which has numpy, requests, PyYAML, tqdm and huggingface_hub but
#           nothing can be fetched there
#   .carry  the pinned llama.cpp sdist (native/lock.yaml), which `moeplug native build` finds in the
#           user cache there as it does here; and a cut of the real gpt-oss-20b routing trace (the
#           whole one does not fit beside a build: 64 MiB travel per call): its prompts 0-249 (to
#           profile) and 400-409 (to replay), renumbered 0-259; later calls add the packed CUDA
#           build (README.md)
#   .gl, .vk  with --vulkan only (the Vulkan calls): Debian 12's Vulkan loader, unpacked into / there as the
#           device tool's README says (.gl), and what a Vulkan build of llama.cpp needs, unpacked beside it
#           (.vk: the Vulkan and SPIR-V headers, glslc and its library)
# Needs pip's access to PyPI (and Debian's, with --vulkan); takes about a minute. Safe to run again.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
if [ "${1:-}" = "--vulkan" ]; then
    for d in /.gl/ /.vk/; do
        grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
    done
    mkdir -p .gl .vk /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    apt-get $o update -q > /dev/null
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    (cd .vk && apt-get $o download libvulkan-dev glslc libshaderc1 spirv-headers)
    du -sh .gl .vk
fi
for d in /.whl/ /.carry/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
mkdir -p .whl .carry

py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    gguf==0.19.0 nvidia-ml-py==13.615.71 textual==8.2.8 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
    Pygments==2.21.0 platformdirs==4.14.9 typing_extensions==4.16.0 watchdog==7.1.1 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1

# the sdist, fetched and checked as `moeplug native build` does (from the user cache where a build
# here already fetched it)
"$py" - <<'PY'
import shutil
from pathlib import Path
from moeplug.native.lock import load_spec
from moeplug.native.source import fetch_sdist
from moeplug.core.paths import state_dir

lock = load_spec().lock
log = state_dir() / "logs" / "device-prepare.log"
log.parent.mkdir(parents=True, exist_ok=True)
src = fetch_sdist(lock, log)
dst = Path(".carry") / src.name
if not dst.exists():
    shutil.copyfile(src, dst)
print(f"{dst} ({dst.stat().st_size / 2**20:.1f} MiB)")
PY

trace=${MOEPLUG_TRACE:-$root/../shared/data/traces/gpt-oss-20b/decode-routing-mmlu.npz}
if [ -f "$trace" ]; then
    "$py" - "$trace" .carry/trace-0-250-400-410.npz <<'PY'
import sys
import numpy as np

src, dst = sys.argv[1], sys.argv[2]
z = np.load(src)
off = z["offsets"]
keep = list(range(0, 250)) + list(range(400, 410))
rows = np.concatenate([np.arange(off[p], off[p + 1]) for p in keep])
lens = np.array([off[p + 1] - off[p] for p in keep])
np.savez_compressed(dst, experts=z["experts"][rows], probs=z["probs"][rows],
                    offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
print(f"{dst}: {len(keep)} prompts, {len(rows)} tokens")
PY
else
    echo "no trace at $trace (MOEPLUG_TRACE): the replay calls need one"
fi
du -sh .whl .carry
