"""The import graph of src/tunesmith, read with `ast`: no circle, and the foundations never reach up to a stage.

Every import counts, at module level or inside a function (a lazy import still closes a circle at run time), in
every spelling: `import tunesmith.x`, `from tunesmith.x import y`, `from tunesmith import x`, `from . import x`,
`from .x import y`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tunesmith"
STAGES = ("quantize", "checkpoint", "train", "export", "report", "evaluate", "generate", "merge", "pipeline",
          "compare", "parity", "pte_runtime", "serve", "chat", "cli")
FOUNDATIONS = ("models", "data", "lora")


def _modules() -> dict[str, Path]:
    """'tunesmith.x.y' -> its file; a package is named by its __init__.py."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ["tunesmith", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tunesmith modules that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        # `tunesmith.a.b.func` names the module tunesmith.a.b: keep the longest prefix that is a module
        parts = target.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts and ".".join(parts) != name:
            out.add(".".join(parts))

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tunesmith":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != "tunesmith":
                continue
            for alias in node.names:  # `from tunesmith import x`: x may be a module or a name in tunesmith/__init__
                add(f"{source}.{alias.name}")
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _is_stage(module: str) -> bool:
    return any(module == f"tunesmith.{s}" or module.startswith(f"tunesmith.{s}.") for s in STAGES)


def test_the_graph_reader_sees_every_spelling_of_an_import(tmp_path):
    pkg = tmp_path / "tunesmith"
    (pkg / "export").mkdir(parents=True)
    files = {
        "__init__.py": "def f():\n    from tunesmith.train import train\n",
        "a.py": "import tunesmith.b\n",
        "b.py": "from tunesmith import c\n",
        "c.py": "def f():\n    from .d import x\n",
        "d.py": "from . import e\n",
        "e.py": "import json\n",
        "train.py": "",
        "export/__init__.py": "from . import gguf\nfrom .. import e\n",
        "export/gguf.py": "from tunesmith.export import FORMATS\nfrom ..a import z\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    modules = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = ["tunesmith", *path.relative_to(pkg).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert graph == {
        "tunesmith": {"tunesmith.train"},
        "tunesmith.a": {"tunesmith.b"},
        "tunesmith.b": {"tunesmith.c"},
        "tunesmith.c": {"tunesmith.d"},
        "tunesmith.d": {"tunesmith.e"},
        "tunesmith.e": set(),
        "tunesmith.train": set(),
        "tunesmith.export": {"tunesmith.export.gguf", "tunesmith.e"},
        "tunesmith.export.gguf": {"tunesmith.export", "tunesmith.a"},
    }
    assert find_cycle(graph) == ["tunesmith.export", "tunesmith.export.gguf", "tunesmith.export"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_tunesmith_imports_itself_back_through_a_circle():
    graph = import_graph()
    assert {"tunesmith.models", "tunesmith.storage", "tunesmith.quantformat"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("foundation", FOUNDATIONS)
def test_the_foundations_import_no_stage(foundation):
    graph = import_graph()
    module = f"tunesmith.{foundation}"
    direct = sorted(m for m in graph[module] if _is_stage(m))
    assert not direct, f"{module} imports stage modules {direct}"
    reached = sorted(m for m in _reaches(graph, module) if _is_stage(m))
    assert not reached, f"{module} reaches stage modules {reached} through its imports"


def test_the_training_loop_does_not_write_the_report():
    assert "tunesmith.report" not in import_graph()["tunesmith.train"]
