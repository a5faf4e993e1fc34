"""src/stagewise/envs.py is the one reader of STAGEWISE_* variables: values typed and read when
asked for, and no other module reads os.environ (or os.getenv) for one of them."""
import ast
from pathlib import Path

import pytest

from stagewise import envs

SRC = Path(__file__).resolve().parents[1] / "src" / "stagewise"


def _strings(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "text" constants (a variable's name is often kept in one)."""
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _reads(tree: ast.Module):
    """(line, key expression) of every os.environ.get / os.getenv / os.environ[...] read."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr == "getenv" or (f.attr == "get" and _is_environ(f.value))):
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            yield node.lineno, node.slice


@pytest.mark.parametrize("path", sorted(p for p in SRC.rglob("*.py") if p.name != "envs.py"),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_only_envs_reads_stagewise_variables(path):
    tree = ast.parse(path.read_text())
    names = _strings(tree)
    for line, key in _reads(tree):
        value = key.value if isinstance(key, ast.Constant) else names.get(getattr(key, "id", ""), "")
        assert not str(value).startswith("STAGEWISE_"), \
            f"{path.name}:{line} reads {value} from the environment; use stagewise.envs.{value}"


def test_values_are_typed_and_read_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("STAGEWISE_CACHE", raising=False)
    assert envs.STAGEWISE_CACHE == Path.home() / ".cache" / "stagewise"
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path))          # set after import: it counts
    assert envs.STAGEWISE_CACHE == tmp_path
    monkeypatch.setenv("STAGEWISE_CACHE", "")
    assert envs.STAGEWISE_CACHE == Path.home() / ".cache" / "stagewise"
    monkeypatch.delenv("STAGEWISE_PACKED_WEIGHTS", raising=False)
    assert envs.STAGEWISE_PACKED_WEIGHTS is True
    monkeypatch.setenv("STAGEWISE_PACKED_WEIGHTS", "0")
    assert envs.STAGEWISE_PACKED_WEIGHTS is False
    monkeypatch.delenv("STAGEWISE_API_KEY", raising=False)
    assert envs.STAGEWISE_API_KEY is None
    with pytest.raises(AttributeError):
        envs.STAGEWISE_NO_SUCH_THING  # noqa: B018


def test_kernel_switch(monkeypatch):
    monkeypatch.delenv("STAGEWISE_CPU_KERNELS", raising=False)
    for raw, mode in ((None, "auto"), ("", "auto"), (" Required ", "required"), ("off", "off")):
        if raw is None:
            monkeypatch.delenv("STAGEWISE_KERNELS", raising=False)
        else:
            monkeypatch.setenv("STAGEWISE_KERNELS", raw)
        assert envs.STAGEWISE_KERNELS == mode
    monkeypatch.setenv("STAGEWISE_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="STAGEWISE_KERNELS must be one of auto, required, off"):
        envs.STAGEWISE_KERNELS  # noqa: B018
    monkeypatch.setenv("STAGEWISE_CPU_KERNELS", "0")                   # the older spelling wins
    assert envs.STAGEWISE_KERNELS == "off"


def test_thread_switches_and_the_http_nice(monkeypatch):
    for name in ("STAGEWISE_PIN_THREADS", "STAGEWISE_KEEP_AWAKE", "STAGEWISE_HTTP_NICE"):
        monkeypatch.delenv(name, raising=False)
    assert (envs.STAGEWISE_PIN_THREADS, envs.STAGEWISE_KEEP_AWAKE, envs.STAGEWISE_HTTP_NICE) == (False, True, 5)
    monkeypatch.setenv("STAGEWISE_PIN_THREADS", "1")
    monkeypatch.setenv("STAGEWISE_KEEP_AWAKE", "0")
    monkeypatch.setenv("STAGEWISE_HTTP_NICE", " 0 ")
    assert (envs.STAGEWISE_PIN_THREADS, envs.STAGEWISE_KEEP_AWAKE, envs.STAGEWISE_HTTP_NICE) == (True, False, 0)
    for bad in ("high", "-3", "20"):
        monkeypatch.setenv("STAGEWISE_HTTP_NICE", bad)
        with pytest.raises(ValueError, match="STAGEWISE_HTTP_NICE must be a whole number from 0 to 19"):
            envs.STAGEWISE_HTTP_NICE  # noqa: B018
