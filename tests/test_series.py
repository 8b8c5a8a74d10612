"""native/check-series: what the patch series changes in upstream files, measured on a real series
applied to the pinned tree, and on small git trees whose answer is known."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from moeplug.native.series import SeriesReport, check_limits, limits_of, load_limits, measure_series, measure_tree, write_limits

ROOT = Path(__file__).resolve().parents[1]


def git(tree: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin", "HOME": str(tree)}
    return subprocess.run(["git", *args], cwd=tree, env=env, check=True, capture_output=True, text=True).stdout


def commit(tree: Path, files: dict[str, str], subject: str) -> None:
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", subject)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """An upstream commit, the overlay tag on it, then two patches: a hook point (3 lines) and 20 lines of
    logic in one file, and 5 lines of negative expert ids in another; a test file and a CMakeLists.txt."""
    git(tmp_path, "init", "-q")
    base = "\n".join(f"int upstream_{i};" for i in range(40)) + "\n"
    commit(tmp_path, {"src/a.cpp": base, "src/k.cu": base, "tests/t.cpp": base, "CMakeLists.txt": "x\n"}, "upstream")
    git(tmp_path, "tag", "moeplug-overlay")
    lines = base.splitlines()
    hook = lines[:5] + ["// our hook", "moeplug_hook();", ""] + lines[5:]
    logic = hook[:30] + [f"int logic_{i} = {i};" for i in range(20)] + hook[30:]
    del logic[-2:]  # two upstream lines removed
    commit(tmp_path, {"src/a.cpp": "\n".join(logic) + "\n", "tests/t.cpp": base + "int test_case;\n",
                      "CMakeLists.txt": "x\ny\n"}, "llama : a hook and some logic")
    kern = base.splitlines()
    kern = kern[:10] + [f"if (id{i} < 0) {{ continue; }}" for i in range(5)] + kern[10:]
    commit(tmp_path, {"src/k.cu": "\n".join(kern) + "\n"}, "ggml-cuda : negative expert ids in the kernels")
    return tmp_path


def test_measure_counts_lines_blocks_and_the_negative_ids_apart(tree: Path) -> None:
    files = {f.path: f for f in measure_tree(tree)}
    a, k = files["src/a.cpp"], files["src/k.cu"]
    assert (a.kind, a.added, a.removed, a.changed) == ("code", 23, 2, 25)
    assert a.largest_block == 20 and a.largest_block_at == 31  # the hook's comment and blank line are not code
    assert a.exception_changed == 0 and a.patches == ["llama : a hook and some logic"]
    assert (k.added, k.exception_added, k.exception_changed, k.largest_block, k.largest_exception_block) == (5, 5, 5, 0, 5)
    assert files["tests/t.cpp"].kind == "test" and files["CMakeLists.txt"].kind == "cmake"
    report = SeriesReport(tag="b1", n_patches=2, files=list(files.values()))
    assert report.code_changed == 30 and report.exception_changed == 5
    doc = report.to_json()
    assert (doc["code_changed"], doc["largest_block"], doc["largest_block_file"]) == (30, 20, "src/a.cpp")


def test_limits_name_each_figure_that_grew(tree: Path) -> None:
    report = SeriesReport(tag="b1", n_patches=2, files=measure_tree(tree))
    within = {"code_changed": 30, "negative_ids_changed": 5, "largest_block": 20,
              "files": {"src/a.cpp": 25, "src/k.cu": 5}}
    assert check_limits(report, within) == []
    over = check_limits(report, {**within, "code_changed": 29, "largest_block": 15, "files": {"src/a.cpp": 24}})
    assert len(over) == 4
    assert any("upstream code changed by 30 lines, limit 29" in line for line in over)
    assert any(line.startswith("src/a.cpp: a block of 20") for line in over)
    assert any(line.startswith("src/a.cpp: 25 lines changed") for line in over)
    assert any(line.startswith("src/k.cu: changed by the series, not listed") for line in over)


@pytest.mark.native
def test_the_series_stays_within_its_limits() -> None:
    """The real series on the pinned sdist (fetched as a build fetches it): no figure above
    native/series-limits.yaml, and the limits are no looser than the series needs, so that a
    change that lowers a figure lowers its limit too."""
    report = measure_series()
    limits = load_limits()
    assert check_limits(report, limits) == []
    assert limits == limits_of(report)


def test_written_limits_are_read_back_and_hold_the_figures(tree: Path, tmp_path: Path) -> None:
    report = SeriesReport(tag="b1", n_patches=2, files=measure_tree(tree))
    write_limits(report, tmp_path)
    limits = load_limits(tmp_path)
    assert limits == {"code_changed": 30, "negative_ids_changed": 5, "largest_block": 20,
                      "files": {"src/a.cpp": 25, "src/k.cu": 5}}
    assert check_limits(report, limits) == []


def test_check_series_script_runs_the_command() -> None:
    r = subprocess.run([str(ROOT / "native" / "check-series"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--json" in r.stdout
