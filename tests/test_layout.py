"""The import direction: config/request/plan/checkpoint -> parallel/model -> graph -> planning/kvcache ->
runtime/cluster -> executor -> recovery/grammar -> engine -> core -> server/cli. A module may import only
its own layer or lower ones."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "stagewise"
LAYERS = {"config": 0, "request": 0, "plan": 0, "errors": 0, "checkpoint": 0,
          "envs": 0, "kernels": 0, "parallel": 1, "model": 1, "graph": 2, "planning": 3, "kvcache": 3, "runtime": 4,
          "cluster": 4, "executor": 5, "recovery": 6, "grammar": 6, "engine": 7, "core": 8, "multimodal": 8,
          "server": 9, "cli": 9, "cli_flags": 9, "llm": 9, "__main__": 10, "__init__": 10}


def _layer(parts: list[str]) -> int:
    return LAYERS[parts[0].removesuffix(".py")]


def _imports(path: Path):
    rel = path.relative_to(SRC).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(rel[:-1])[: len(rel) - node.level]
            target = base + (node.module.split(".") if node.module else [])
            if target:
                yield node.lineno, target
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagewise."):
            yield node.lineno, node.module.split(".")[1:]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    own = _layer(list(path.relative_to(SRC).parts))
    for line, target in _imports(path):
        assert _layer(target) <= own, f"{path.name}:{line} imports {'.'.join(target)} from a higher layer"


def test_every_package_has_a_layer():
    """A new package or top-level module gets its layer here (and in docs/architecture.md)."""
    names = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert names <= set(LAYERS), f"no layer for {sorted(names - set(LAYERS))}"
    assert set(LAYERS) <= names, f"LAYERS names modules that are gone: {sorted(set(LAYERS) - names)}"


def test_architecture_page_draws_these_layers():
    """docs/architecture.md's layer table names each package at the layer this test gives it."""
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    table = page[page.index("| layer | packages and modules |"):].split("\n\n")[0]
    drawn = {}
    for row in table.splitlines()[2:]:
        layer, names = (cell.strip() for cell in row.strip("|").split("|"))
        drawn.update({name.strip("` "): int(layer) for name in names.split(",")})
    assert drawn == LAYERS


def test_engine_never_imports_torch_models():
    for path in (SRC / "engine").rglob("*.py"):
        for _, target in _imports(path):
            assert target[0] not in ("model", "graph") or target[:2] == ["graph", "policy"], \
                f"{path.name} imports {'.'.join(target)}"


BENCHMARKS = SRC.parents[1] / "benchmarks"


def _has_main_guard(path: Path) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(path.read_text()).body)


def test_benchmarks_have_one_entry_point_per_question():
    """At most ~15 `python -m benchmarks.X` entry points: top-level modules run as scripts and area
    packages; below the top level only workers/ runs as a script. Every benchmark an area names is a
    module of that area with a `main`."""
    modules = [p.stem for p in BENCHMARKS.glob("*.py") if _has_main_guard(p)]
    areas = [p.parent.name for p in BENCHMARKS.glob("*/__main__.py")]
    assert len(modules) + len(areas) <= 16, sorted(modules + areas)
    nested = [p for p in BENCHMARKS.glob("*/**/*.py") if p.parent.name not in ("workers", "harness")
              and p.name != "__main__.py" and _has_main_guard(p)]
    assert not nested, f"only workers/ run as scripts below the top level: {nested}"
    for main in BENCHMARKS.glob("*/__main__.py"):
        for call in (n for n in ast.walk(ast.parse(main.read_text())) if isinstance(n, ast.Call)
                     and getattr(n.func, "id", "") == "run_subcommand"):
            for target, _ in ast.literal_eval(call.args[2]).values():
                path = BENCHMARKS.parent / (target.replace(".", "/") + ".py")
                assert path.parent == main.parent, f"{main.parent.name} names {target}, not one of its modules"
                names = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]
                assert "main" in names, f"{path} has no main"


def test_benchmarks_write_no_machine_paths():
    """Where a run keeps what it downloads or makes, and where a peer's interpreter is, come from
    flags, the environment or the cache dir (benchmarks/common.py), never a development machine's paths."""
    for path in BENCHMARKS.rglob("*.py"):
        text = path.read_text()
        for prefix in ("/opt/", "/work/", "/scratch/", "/home/"):
            assert prefix not in text, f"{path.relative_to(BENCHMARKS)} names a machine path ({prefix}...)"


def test_an_area_runs_its_benchmark_by_name(monkeypatch, capsys):
    from benchmarks import run_subcommand
    commands = {"time": ("timeit", "how long a statement takes")}    # a module whose main() reads sys.argv
    for argv, code in ((["area"], 2), (["area", "nope"], 2), (["area", "--help"], 0)):
        monkeypatch.setattr("sys.argv", argv)
        with pytest.raises(SystemExit) as exit_:
            run_subcommand("benchmarks.area", "An area.", commands)
        assert exit_.value.code == code
        out = capsys.readouterr()
        assert "python -m benchmarks.area NAME" in (out.out if code == 0 else out.err)
        assert "time  how long a statement takes" in (out.out if code == 0 else out.err)
    monkeypatch.setattr("sys.argv", ["area", "time", "-n", "3", "-r", "1", "pass"])
    with pytest.raises(SystemExit) as exit_:
        run_subcommand("benchmarks.area", "An area.", commands)
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("3 loops, best of 1:")
