"""No import cycles in the package or in benchmarks/: every `import`/`from ... import` of one of
its modules, at module level or inside a function (where a cycle hides from Python's own checks),
is an edge; the graph of modules must have no cycle. A name imported from a package counts as its
submodule when one has that name, else as the package's `__init__`. The benchmarks are a package
run with `python -m benchmarks.<name>`: no `sys.path` edits, nothing from tests/, and no private
name of another benchmark module."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "stagewise"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _modules(root: Path = SRC) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        if "results" in path.relative_to(root).parts:
            continue
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {t for t in found if t in mods and t != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as a path that starts and ends at the same module), or None."""
    state: dict[str, int] = {}            # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for nxt in sorted(graph[mod]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    mods = _modules()
    graph = {name: _targets(name, path, mods) for name, path in mods.items()}
    assert sum(map(len, graph.values())) > 100         # the walk sees the package's imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_finds_a_cycle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_benchmarks_are_a_package_without_cycles_or_path_edits():
    mods = _modules(BENCHMARKS)
    assert "benchmarks" in mods and len(mods) > 20
    graph = {name: _targets(name, path, mods) for name, path in mods.items()}
    assert sum(map(len, graph.values())) > 20          # the walk sees `from benchmarks.common import ...`
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    for path in mods.values():
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path; import through the benchmarks package"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in ("tests", "launcher", "conftest"), f"{path.name} imports tests"
                if node.module.startswith("benchmarks"):
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, f"{path.name} imports {private} from {node.module}"
