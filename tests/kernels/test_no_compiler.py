"""A machine without a C or C++ compiler starts: the engine runs eager on PyTorch's own ops, with
one log line from the kernels and one from the graph policy (Inductor needs a C++ compiler), and
answers what the kernel-free eager run answers."""
import os
import subprocess
import sys

import pytest

from stagewise.graph.policy import resolve_graph_policy

ARGS = ("generate", "--prompt", "Once upon a time", "--max-tokens", "6", "--ignore-eos", "--no-chat")


def test_policy_runs_eager_without_a_cxx_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    policy = resolve_graph_policy("compiled", decode_graph="compiled")
    assert policy.backend == "off" and policy.decode_backend == "off" and not policy.enabled
    assert sum("Inductor needs a C++ compiler" in line for line in policy.log_lines) == 1
    monkeypatch.delenv("CXX")
    assert resolve_graph_policy("compiled").backend == "compiled"


def _generate(model_dir, env: dict, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagewise", "--log-level", "WARNING", *ARGS, "--model",
                           str(model_dir), *flags], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_generate_without_any_compiler(llama_dir, tmp_path):
    base = {**os.environ, "STAGEWISE_CACHE": str(tmp_path / "cache")}
    base.pop("CC", None), base.pop("CXX", None)
    empty = tmp_path / "bin"
    empty.mkdir()
    bare = _generate(llama_dir, {**base, "PATH": str(empty), "STAGEWISE_KERNELS": "auto"},
                     "--prefill-graph", "compiled")
    ref = _generate(llama_dir, {**base, "STAGEWISE_KERNELS": "off"}, "--prefill-graph", "off")
    assert bare.returncode == 0, bare.stderr
    assert ref.returncode == 0, ref.stderr
    assert bare.stdout == ref.stdout and bare.stdout.startswith("Once upon a time")
    warnings = [line for line in bare.stderr.splitlines() if line.startswith("WARNING")]
    assert sum("no C compiler (CC=cc is not on PATH)" in line for line in warnings) == 1, bare.stderr
    assert not (tmp_path / "cache" / "kernels").exists()
