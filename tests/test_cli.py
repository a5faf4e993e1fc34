"""The command line, run as a user would: subprocesses of `python -m stagewise`."""
import re
import subprocess
import sys

import pytest

from stagewise.cli import main


def run(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "stagewise", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("serve", "generate", "bench", "plan", "demo-model"):
        assert cmd in out.stdout


@pytest.mark.slow
def test_generate_on_demo_model_streams_text(tmp_path):
    demo = run("demo-model", "--out", str(tmp_path / "demo"))
    assert demo.returncode == 0, demo.stderr
    out = run("--log-level", "WARNING", "generate", "--model", str(tmp_path / "demo"), "--prompt", "Once upon",
              "--max-tokens", "12", "--ignore-eos", "--no-chat")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon") and len(out.stdout.strip()) > len("Once upon")
    summary = out.stderr.strip().splitlines()[-1]           # one line at the end, apart from the text
    assert re.fullmatch(r"12 tokens in \d+\.\d\d s \(\d+\.\d tok/s\); \d+\.\d s in all since the command started "
                        r"\(\d+\.\d s of it start-up\)", summary), summary


@pytest.mark.slow
def test_generate_uses_the_chat_template_when_the_model_has_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path))   # "demo" builds the demo model here
    args = ["--log-level", "WARNING", "generate", "--model", "demo", "--max-tokens", "6", "--ignore-eos"]
    assert main(args + ["--prompt", "Hi"]) == 0
    question, answer = capsys.readouterr().out.split("\n", 1)
    assert question == "Hi" and answer.strip() and "<|user|>" not in answer   # the question, then the reply
    assert main(args + ["--prompt", "Hi", "--no-chat"]) == 0
    assert capsys.readouterr().out.startswith("Hi") and (tmp_path / "demo-model" / "model.safetensors").exists()


def test_plan_prints_stage_table(llama_dir, llama_uneven_dir, capsys):
    assert main(["plan", "--model", str(llama_dir), "--pp-size", "3", "--pp-layer-partition", "even",
                 "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "[0,1)" in out and "[1,2)" in out and "[2,4)" in out and "partition: even: 1,1,2" in out
    assert "KV capacity" in out.splitlines()[-1]
    # each of 2 ranks holds half the weights (llama: 4 layers, vocabulary-parallel embedding and head)
    assert main(["plan", "--model", str(llama_dir), "--tp-size", "2", "--pp-size", "2", "--dtype", "float32",
                 "--pp-layer-partition", "even"]) == 0
    out = capsys.readouterr().out
    assert "2 stage(s) x 2 tensor-parallel ranks" in out
    assert main(["plan", "--model", str(llama_dir), "--pp-size", "2", "--dtype", "float32",
                 "--pp-layer-partition", "even"]) == 0
    whole = capsys.readouterr().out

    def column(text, index):       # a column of the table's rows (stage, or stage/rank)
        rows = [line.split() for line in text.splitlines() if line.strip()[:2] in ("0 ", "1 ", "0/", "1/")]
        return [float(row[index]) for row in rows]
    tp = column(out, 3)                 # weights MiB (after stage, layers and process MiB)
    assert tp[0] == tp[1] and [tp[0] + tp[1], tp[2] + tp[3]] == pytest.approx(column(whole, 3), abs=0.11)
    # 9 q heads in 3 KV groups: rank 1 holds twice rank 0's KV heads (and more weights); one block count
    assert main(["plan", "--model", str(llama_uneven_dir), "--tp-size", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    weights, kv, blocks = column(out, 3), column(out, 7), column(out, 8)
    assert weights[1] >= weights[0] and kv[1] == pytest.approx(2 * kv[0], rel=0.01) and blocks[0] == blocks[1]


@pytest.mark.parametrize("args,message", [
    (["plan", "--pp-size", "3", "--pp-layer-partition", "3,3"], "pp_layer_partition"),
    (["generate", "--prefill-graph", "sometimes"], "prefill_graph must be one of"),
    (["generate", "--model", "/nonexistent/dir"], "/nonexistent/dir"),
    # refused before loading, naming the sizes that split the model
    (["plan", "--tp-size", "3"], "--tp-size 3 cannot split this model (4 attention heads, 2 KV heads, 1000 "
                                 "vocabulary entries); use --tp-size 1, 2 or 4."),
    (["generate", "--tp-size", "5"], "--tp-size 5 cannot split this model (4 attention heads"),
])
def test_bad_flags_get_one_clear_sentence(llama_dir, capsys, args, message):
    if args[0] == "plan" or "--tp-size" in args:
        args = args + ["--model", str(llama_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_prompt_too_long_for_the_context_prints_only_the_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path))
    long_prompt = "tell me more " * 2000
    assert main(["--log-level", "WARNING", "generate", "--model", "demo", "--max-model-len", "128",
                 "--prompt", long_prompt]) == 2
    out, err = capsys.readouterr()
    assert out == ""                                    # the prompt is not echoed before the error
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("built the CPU kernels")]  # a first build
    assert "context is 128" in err and len(lines) == 1 and len(lines[0]) < 400


def test_help_shows_defaults_and_says_generate_is_greedy():
    generate = run("generate", "--help", timeout=60).stdout
    assert "greedy by default" in generate and "OpenAI" in generate
    flat = " ".join(generate.split())
    assert "--temperature TEMPERATURE 0 (or below 1e-5): greedy (default: 0.0)" in flat
    assert "--max-tokens MAX_TOKENS tokens to generate, at most (default: 64)" in flat
    assert "--block-size BLOCK_SIZE tokens per KV cache block (default: 16)" in flat
    serve = " ".join(run("serve", "--help", timeout=60).stdout.split())
    assert "--graceful-timeout SECONDS" in serve and "(default: 10.0)" in serve and "--body-timeout" in serve
    assert "--port PORT port to listen on (default: 8000)" in serve


@pytest.mark.parametrize("args,message", [
    (["generate", "--kv-cache-memory", "2"], "kv_cache_memory '2' is 2 bytes, less than 4096; write a unit"),
    (["generate", "--kv-cache-memory", "lots"], "kv_cache_memory 'lots' is not a size"),
    (["serve", "--max-request-bytes", "big"], "max_request_bytes 'big' is not a size"),
    (["generate", "--stop-token-ids", "2,x"], "stop_token_ids must be a comma-separated list of integers"),
])
def test_sizes_and_lists_share_one_rule_and_one_sentence(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_generate_compiles_only_jobs_that_can_win_it_back():
    from stagewise.cli import GENERATE_COMPILE_MIN_TOKENS, _small_jobs_skip_compiling
    from stagewise.config import EngineConfig
    auto = EngineConfig.from_kwargs(model="x")
    assert _small_jobs_skip_compiling(auto, 64).graphs.prefill_graph == "off"
    assert _small_jobs_skip_compiling(auto, GENERATE_COMPILE_MIN_TOKENS).graphs.prefill_graph == "auto"
    assert _small_jobs_skip_compiling(auto.replace(prefill_graph="compiled"), 64).graphs.prefill_graph == "compiled"


def _cluster_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("stage  node"))
    return [line.split() for line in lines[head + 1:] if line.strip()[:1].isdigit()]


def test_plan_over_a_described_cluster(llama_dir, capsys):
    # the tiny llama: a process's runtime dominates; node 2's budget holds none, node 0's the driver and a stage
    args = ["plan", "--model", str(llama_dir), "--dtype", "float32"]
    assert main([*args, "--cluster", "1.6GiB:1.0,1.6GiB:0.5,200MiB:0.3"]) == 0
    out = capsys.readouterr().out
    rows = _cluster_rows(out)
    assert [r[1] for r in rows] == ["0", "1"] and out.startswith("cluster plan: 3 node(s), 2 stage(s)")
    assert "node 2 (200.0 MiB, speed 0.3) is left out: its budget" in out
    # a stage forked from its node's warm process shares its modules: one process's worth either way, so a
    # 520 MiB node 0 holds the driver and a stage with or without warm processes
    for spares in ("--pipeline-spares", "--no-pipeline-spares"):
        assert main([*args, "--cluster", "520MiB:1.0,520MiB:0.5,200MiB:0.3", spares]) == 0
        assert [r[1] for r in _cluster_rows(capsys.readouterr().out)] == ["0", "1"]
    assert main([*args, "--cluster", "2GiB,2GiB", "--pp-size", "4"]) == 0
    nodes = [r[1] for r in _cluster_rows(capsys.readouterr().out)]     # the head-heavy last stage alone
    assert len(nodes) == 4 and nodes == sorted(nodes) and set(nodes) == {"0", "1"}
    assert main([*args, "--cluster", "2GiB,2GiB", "--pp-size", "2", "--pp-layer-partition", "1,3"]) == 0
    assert [r[5] for r in _cluster_rows(capsys.readouterr().out)] == ["[0,1)", "[1,4)"]
    assert main([*args, "--cluster", "300MiB,200MiB"]) == 2
    assert re.search(r"^error: The nodes together cannot hold the model: .* is missing", capsys.readouterr().err)
    assert main([*args, "--cluster", "2GiB:fast"]) == 2
    assert "error: --cluster node '2GiB:fast' has speed 'fast'" in capsys.readouterr().err


def test_plan_over_a_cluster_on_a_gguf_file(llama_dir, tmp_path, capsys):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("gguf_fixtures", Path(__file__).parent / "model" / "conftest.py")
    assert spec is not None and spec.loader is not None
    fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixtures)
    path = fixtures.write_gguf(llama_dir, tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    assert main(["plan", "--model", str(path), "--cluster", "3GiB:1.0,2GiB:1.0"]) == 0
    rows = _cluster_rows(capsys.readouterr().out)
    assert [r[1] for r in rows] == ["0", "1"] and sum(float(r[6]) for r in rows) > 0
