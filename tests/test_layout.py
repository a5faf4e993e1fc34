"""The import direction: config/request/plan -> parallel/model -> graph -> runtime -> executor ->
recovery/grammar -> engine -> serve -> server/cli. A module may import only its own layer or lower ones."""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "stagewise"
LAYERS = {"config": 0, "request": 0, "plan": 0, "errors": 0, "checkpoint": 0, "gguf_meta": 0, "envs": 0,
          "kernels": 0, "parallel": 1, "model": 1, "graph": 2, "runtime": 3, "executor": 4, "recovery": 5,
          "grammar": 5, "engine": 6, "serve": 7, "server": 8, "cli": 8,
          "cli_flags": 8, "llm": 8, "__main__": 9, "__init__": 9}


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


def test_engine_never_imports_torch_models():
    for path in (SRC / "engine").rglob("*.py"):
        for _, target in _imports(path):
            assert target[0] not in ("model", "graph") or target[:2] == ["graph", "policy"], \
                f"{path.name} imports {'.'.join(target)}"
