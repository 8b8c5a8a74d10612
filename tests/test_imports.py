"""The plugin's imports run one way, from the command line down to the small parts, with no
cycles; and library modules never print (progress goes to a callback).

The package is a house of rooms (its subpackages); ROOMS below lists them from the bottom up, and a
module's rank is its room's. A module may import its own room and the rooms below it. The list is
the whole rule: a new module needs no entry, a new room does.

Read from the source with ast, lazy imports inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"moeplug": ROOT / "plugin", "moeplug.tui": ROOT / "tui"}

# the rooms, bottom up; rooms of one rank do not import each other
ROOMS: list[tuple[str, ...]] = [
    ("core",),
    ("machine",),
    ("model", "native"),
    ("profile",),
    ("planner",),
    ("serving",),
    ("hooks",),
    ("operations",),
    ("commands",),
    ("tui", "__main__"),  # `moeplug tui` is found by name (commands.main.COMMAND_MODULES), not imported
]
CLI_RANK = len(ROOMS) - 2  # the commands and everything above them may print
TOP_LEVEL = {"moeplug"}  # the package's own __init__: its version, nothing else


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "moeplug" else None


def rank(module: str) -> int | None:
    if module in TOP_LEVEL:
        return 0
    room = room_of(module)
    return next((r for r, rooms in enumerate(ROOMS) if room in rooms), None)


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
    assert [m for m in modules() if rank(m) is None] == [], "a module outside every room: add its room to ROOMS"


def test_the_house_has_few_rooms() -> None:
    """At the top of the package: its rooms and the entry point, nothing loose."""
    top = sorted(p.stem if p.is_file() else p.name for p in (ROOT / "plugin").iterdir()
                 if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").exists()))
    rooms = sorted(r for rooms in ROOMS for r in rooms if r != "tui")
    assert top == sorted(["__init__", *rooms])
    assert len(rooms) <= 12


def test_rooms_of_one_rank_do_not_import_each_other() -> None:
    crossing = [f"{m} -> {d}" for m, deps in import_graph().items() for d in sorted(deps)
                if rank(m) == rank(d) and room_of(m) != room_of(d) and m not in TOP_LEVEL and d not in TOP_LEVEL]
    assert crossing == []


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
        if (rank(name) or 0) >= CLI_RANK or name == "moeplug.core.output":
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
    assert "moeplug.operations.actions" in graph["moeplug.commands.profile"]  # imported inside cmd_run()
    assert "moeplug.serving.launch" in graph["moeplug.operations.actions"]  # imported inside serve()
    assert rank("moeplug.commands.install") == CLI_RANK and rank("moeplug.profile.format") < rank("moeplug.planner.plan") and rank("moeplug") == 0
