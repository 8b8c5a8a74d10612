"""A built wheel carries everything the checkout has: code, native/ data, bundled prompts."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
sys.path[:0] = sys.argv[1:3]
import moeplug
from moeplug.native.lock import load_spec, native_dir
from moeplug.profile.runner import bundled_prompts_dir
spec = load_spec()
print(json.dumps({"package": moeplug.__file__, "native": str(native_dir()), "prompts": str(bundled_prompts_dir()),
                  "patches": [p.name for p in spec.patches], "overlay": [str(p) for p in spec.overlay_files],
                  "digest": spec.digest(stock=False)}))
"""


def test_wheel_installs_with_its_data(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("moeplug-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("moeplug/commands/main.py", "moeplug/planner/plan.py", "moeplug/model/synth/archs.py",
                     "moeplug/tui/__init__.py", "moeplug/tui/dashboard.tcss",
                     "moeplug/tui/screens/main.py", "moeplug/tui/widgets/slots.py", "moeplug/hooks/llama_swap.py",
                     "moeplug/_native/lock.yaml",
                     "moeplug/_native/overlay/tools/moe-profile/moe-profile.cpp", "moeplug/_prompts/codeish.txt",
                     "moeplug/_recipes/qwen3-30b-a3b.yaml"):
        assert expected in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # -S: no site hooks, so the checkout's editable install cannot answer for the wheel
    deps = sysconfig.get_paths()["purelib"]
    r = subprocess.run([sys.executable, "-S", "-c", PROBE, str(target), deps], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    wheel_view = json.loads(r.stdout)
    assert wheel_view["package"].startswith(str(target))
    assert wheel_view["native"] == str(target / "moeplug" / "_native")
    assert wheel_view["prompts"] == str(target / "moeplug" / "_prompts")
    r = subprocess.run([sys.executable, "-c", PROBE, "", ""], capture_output=True, text=True, cwd=tmp_path)
    checkout_view = json.loads(r.stdout)
    assert checkout_view["native"] == str(ROOT / "native")
    # same patches, same overlay, same digest: a wheel install reuses the checkout's build ids
    for key in ("patches", "overlay", "digest"):
        assert wheel_view[key] == checkout_view[key]
