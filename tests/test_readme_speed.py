"""README.md's speed table is what native/bench/speed_table.py prints from the committed runs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "native" / "bench" / "speed_table.py"
START = "<!-- speed table: python native/bench/speed_table.py -->"
END = "<!-- end of speed table -->"


def _script():
    spec = importlib.util.spec_from_file_location("speed_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["speed_table"] = module
    spec.loader.exec_module(module)
    return module


def readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert found, f"README.md must hold the speed table between {START} and {END}"
    return found[1]


def test_the_readme_table_is_what_the_script_prints() -> None:
    printed = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert readme_table() == printed.stdout


def test_every_row_reads_a_committed_run_with_its_run_json() -> None:
    module = _script()
    assert 0 < len(module.ROWS) <= 10
    for row in module.ROWS:
        run = (module.RESULTS / row.path).relative_to(module.RESULTS).parts[0]
        assert (module.RESULTS / row.path).is_file(), row.path
        assert (module.RESULTS / run / "run.json").is_file(), run
    for line in readme_table().splitlines()[2:]:
        assert "rounds" in line and "stock:" in line and "build" in line, line


def test_a_missing_run_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys) -> None:
    module = _script()
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    assert module.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run output" in err
    assert module.main(["--x"]) == 2
