"""The command line, run as a user would: subprocesses of `python -m stagewise`."""
import subprocess
import sys

import pytest


def run(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "stagewise", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("serve", "generate", "bench", "plan", "demo-model"):
        assert cmd in out.stdout


def test_generate_on_demo_model_streams_text(tmp_path):
    demo = run("demo-model", "--out", str(tmp_path / "demo"))
    assert demo.returncode == 0, demo.stderr
    out = run("--log-level", "WARNING", "generate", "--model", str(tmp_path / "demo"), "--prompt", "Once upon",
              "--max-tokens", "12", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon") and len(out.stdout.strip()) > len("Once upon")


def test_plan_prints_stage_table(llama_dir):
    out = run("plan", "--model", str(llama_dir), "--pp-size", "3", "--kv-cache-memory", "64MiB")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "[0,1)" in out.stdout and "[1,2)" in out.stdout and "[2,4)" in out.stdout
    assert "KV capacity" in lines[-1]


@pytest.mark.parametrize("args,message", [
    (["plan", "--pp-size", "3", "--pp-layer-partition", "3,3"], "pp_layer_partition"),
    (["generate", "--prefill-graph", "sometimes"], "prefill_graph must be one of"),
    (["generate", "--model", "/nonexistent/dir"], "/nonexistent/dir"),
])
def test_bad_flags_get_one_clear_sentence(llama_dir, args, message):
    if args[0] == "plan":
        args = args + ["--model", str(llama_dir)]
    out = run(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
