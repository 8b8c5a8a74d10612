"""The plugin's imports run one way, cli -> install -> plan -> allocate -> profile/native/model_inspect
-> small helpers, with no cycles; and library modules never print (progress goes to a callback).

Read from the source with ast, lazy imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"moeplug": ROOT / "plugin", "moeplug.tui": ROOT / "tui"}

# A module may import modules of its own rank or below. Listed by name or by prefix (a package).
RANKS: list[tuple[int, tuple[str, ...]]] = [
    (6, ("moeplug.__main__", "moeplug.cli", "moeplug.install_cli", "moeplug.profile.cli", "moeplug.native.cli",
         "moeplug.tui", "moeplug.trace_cli", "moeplug.hooks.cli", "moeplug.reprofile_cli", "moeplug.schedule_cli",
         "moeplug.bench_cli")),
    (5, ("moeplug.actions", "moeplug.monitor", "moeplug.hooks.watch", "moeplug.reprofile", "moeplug.bench")),
    (4, ("moeplug.install",)),
    (3, ("moeplug.plan", "moeplug.hooks")),
    (2, ("moeplug.allocate", "moeplug.estimates", "moeplug.server_flags", "moeplug.multi_gpu",
         "moeplug.speculation")),
    (1, ("moeplug.profile", "moeplug.native", "moeplug.model_inspect", "moeplug.synth", "moeplug.refs",
         "moeplug.demo", "moeplug.download", "moeplug.serving", "moeplug.server", "moeplug.metrics", "moeplug.trace",
         "moeplug.schedule", "moeplug.measure")),
    (0, ("moeplug", "moeplug.errors", "moeplug.paths", "moeplug.fsutil", "moeplug.output", "moeplug.progress",
         "moeplug.runlog", "moeplug.sizes", "moeplug.gpu", "moeplug.probes", "moeplug.archs", "moeplug.options",
         "moeplug.fit_estimate", "moeplug.split", "moeplug.traffic")),
]
CLI_RANK = RANKS[0][0]


def rank(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching name, rank): the longest match wins
    for r, names in RANKS:
        for name in names:
            if module == name or (module.startswith(name + ".") and name != "moeplug"):
                if best is None or len(name) > best[0]:
                    best = (len(name), r)
    return best[1] if best else None


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            deps |= {t for t in targets if t in mods}
        # a package's own submodules are its parts, not a dependency either way
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".") and not d.startswith(name + ".")}
    return graph


def test_every_module_has_a_rank() -> None:
    assert [m for m in modules() if rank(m) is None] == [], "add new modules to RANKS in tests/test_imports.py"


def test_imports_run_one_way() -> None:
    upward = [f"{m} -> {d}" for m, deps in import_graph().items() for d in sorted(deps)
              if (rank(d) or 0) > (rank(m) or 0)]
    assert upward == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_library_modules_do_not_print() -> None:
    """Below the CLI, output goes through results and progress callbacks, never to the terminal."""
    printing = []
    for name, path in modules().items():
        if (rank(name) or 0) >= CLI_RANK or name == "moeplug.output":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            label = called.id if isinstance(called, ast.Name) else called.attr if isinstance(called, ast.Attribute) \
                else None
            if label in ("print", "note", "ProgressBar", "print_json"):
                printing.append(f"{name}:{node.lineno} {label}()")
    assert printing == []


def test_the_walker_sees_lazy_imports() -> None:
    """Imports inside functions count (the ones a cycle would hide in)."""
    graph = import_graph()
    assert "moeplug.actions" in graph["moeplug.profile.cli"]  # imported inside cmd_run()
    assert "moeplug.serving" in graph["moeplug.actions"]  # imported inside serve()
    assert rank("moeplug.install_cli") == CLI_RANK and rank("moeplug.profile.format") == 1 and rank("moeplug") == 0
