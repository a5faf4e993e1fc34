"""The user's `EngineConfig` stays what the user asked for: what start-up works out (the layer
partition, the node's memory) is a separate record, `planning.resolved.Resolved`. A copy of a config
with options changed (`config.replace(...)`) is made only in the places listed here, each for the
reason given; a new one fails this test (return the fact in `Resolved` instead, or add it here
with its reason)."""
import ast
from collections import Counter
from pathlib import Path

from stagewise.config import CONCERN_OF, CONCERNS

SRC = Path(__file__).resolve().parents[1] / "src" / "stagewise"
OPTION_NAMES = set(CONCERN_OF) | {attr for attr, _, _ in CONCERNS}

# (module, function) -> how many copies it makes, and why that copy is not a rewrite of the user's config
ALLOWED = {
    ("config.py", "from_kwargs"): (1, "building: the defaults with the user's options"),
    ("engine/speculative.py", "draft_config"): (1, "building: the draft model's own config from the defaults"),
    ("cli.py", "_small_jobs_skip_compiling"): (1, "the command's default, before the engine is built: a "
                                                  "short `generate` runs eager unless a graph was asked for"),
    ("model/source.py", "resolve_models"): (2, "the user's request completed at the entry, before the "
                                               "engine is built: the model named (or the default) as a path"),
    ("cluster/node_options.py", "adopt_options"): (1, "the user's options arriving: a node runs the "
                                                       "driver's options, shipped at the handshake"),
    ("planning/report.py", "_remedy"): (1, "a what-if: the config of a larger pipeline, to say whether it "
                                           "would fit; never handed on"),
    ("planning/resolved.py", "launch_config"): (1, "the one place start-up facts join the options a stage "
                                                   "process is started with (the record crossing the process "
                                                   "boundary carries both)"),
    ("cluster/ray_nodes.py", "start_ray_nodes"): (1, "the user's request completed at the entry, before the "
                                                     "engine is built: the leader of the nodes Ray placed, "
                                                     "as `--nnodes`/`--node-rank` flags would give it"),
    ("recovery/supervisor.py", "_new_executor"): (1, "a one-node rebuild asks for a free port, as a user "
                                                     "who named none does"),
}


def _config_copies(path: Path):
    """(function, line) of each `X.replace(option=...)` call in `path` (str.replace and os.replace
    take no option names; `dataclasses.replace` is on other records)."""
    tree = ast.parse(path.read_text())
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "replace" and node.keywords):
                continue
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "dataclasses":
                continue
            if any(k.arg is None or k.arg in OPTION_NAMES for k in node.keywords):
                yield fn.name, node.lineno


def _found() -> Counter:
    found: Counter = Counter()
    for path in SRC.rglob("*.py"):
        for function, _ in _config_copies(path):
            found[(str(path.relative_to(SRC)), function)] += 1
    return found


def test_config_is_copied_only_where_allowed():
    found = _found()
    extra = {k: n for k, n in found.items() if n > ALLOWED.get(k, (0, ""))[0]}
    assert not extra, (f"new copies of an EngineConfig with options changed: {extra}; keep what start-up works "
                       f"out in planning.resolved.Resolved, not in the user's config")


def test_allowed_list_is_current():
    """An entry whose copy is gone is removed, so the list only shrinks to what is really there."""
    found = _found()
    stale = {k for k, (n, _) in ALLOWED.items() if found[k] < n}
    assert not stale, f"ALLOWED names copies that are gone: {sorted(stale)}; lower or remove their entries"


def test_the_scan_sees_a_copy(tmp_path, monkeypatch):
    """The scan finds a rewrite it must refuse (the test can fail)."""
    module = tmp_path / "m.py"
    module.write_text("def start(config, measured):\n    return config.replace(node_memory_bytes=measured)\n"
                      "def text(s):\n    return s.replace('a', 'b')\n")
    assert [f for f, _ in _config_copies(module)] == ["start"]
