"""The first hour of a new user: the default answer, honest first-run numbers, early checks with
one-sentence errors (no model loads for the checks; the numbers use the demo model)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from stagewise.model.loader import EXACT_MAX_HIDDEN, exact_mode


@pytest.mark.parametrize("dtype, hidden, exact", [
    ("auto", 576, True),                    # the default model (SmolLM2-135M): exact, so it answers "Paris"
    ("auto", EXACT_MAX_HIDDEN - 1, True),
    ("auto", EXACT_MAX_HIDDEN, False),      # wider models: the fast mode (8-bit activations)
    ("auto", 4096, False),
    ("float32", 4096, True),                # asked for by name: always exact
    (torch.float32, 4096, True),
    ("bfloat16", 576, False),               # asked for by name: always fast
    ("float16", 576, False),
])
def test_quantized_mode_by_dtype_and_model_width(dtype, hidden, exact):
    assert exact_mode(dtype, SimpleNamespace(hidden_size=hidden)) is exact


def _generate(env: dict[str, str]) -> tuple[str, float]:
    """`stagewise generate` on the demo model in a fresh process: (stdout and stderr in order, stopwatch s)."""
    import subprocess
    import sys
    import time
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "stagewise", "generate", "--model", "demo", "--max-tokens", "8",
                           "--prompt", "Hello"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    stopwatch = time.perf_counter() - started
    assert done.returncode == 0, done.stdout
    return done.stdout, stopwatch


def _total_s(out: str) -> float:
    import re
    found = re.search(r"; ([0-9.]+) s in all since the command started", out)
    assert found, out
    return float(found.group(1))


@pytest.mark.slow
def test_generate_total_matches_a_stopwatch():
    import os
    out, stopwatch = _generate(dict(os.environ))
    # NOTE: the process exits after printing: its teardown is the only time the total leaves out
    assert stopwatch - 1.0 <= _total_s(out) <= stopwatch + 0.1        # printed to 0.1 s


@pytest.mark.slow
def test_first_run_builds_kernels_before_the_prompt(tmp_path):
    import os

    from stagewise.model.demo import ensure_demo_model
    (tmp_path / "demo-model").symlink_to(ensure_demo_model(), target_is_directory=True)   # kernels alone fresh
    out, stopwatch = _generate({**os.environ, "STAGEWISE_CACHE": str(tmp_path)})
    built = out.index("built the CPU kernels in")
    assert built < out.index("Hello") and stopwatch - 1.0 <= _total_s(out) <= stopwatch + 0.1
    # the builds are start-up: the tokens' time is far below them
    tokens_s = float(out.split(" tokens in ")[1].split(" s ")[0])
    assert tokens_s < float(out[built:].split(" in ")[1].split(" s ")[0])


def test_bench_says_how_its_steps_ran(capsys):
    from stagewise.cli import _steps_text, main
    assert main(["--log-level", "WARNING", "bench", "--model", "demo", "--num-requests", "2", "--output-len", "4"]) == 0
    out = capsys.readouterr().out.strip()
    assert "tok/s (eager: every step, --prefill-graph auto); time to first token" in out
    assert re.search(r"; \d+ engine steps$", out), out
    assert _steps_text(10, 0, 0.0, "auto") == "compiled graphs"
    assert _steps_text(7, 3, 42.0, "auto") == ("compiled graphs, 3 of 10 steps eager; waited 42.0 s for the "
                                               "background compile first")
    assert _steps_text(7, 3, None, "auto").startswith("graphs: the stages compile in the background")


def _one_sentence_error(capsys, argv: list[str]) -> str:
    from stagewise.cli import main
    assert main(["--log-level", "ERROR", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.fixture
def no_loading(monkeypatch):
    """Any engine start fails the test: these refusals come before the model loads."""
    import stagewise.llm
    monkeypatch.setattr(stagewise.llm, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))


def test_a_busy_port_is_refused_before_the_model_is_resolved(capsys, monkeypatch):
    import socket

    import stagewise.cli
    monkeypatch.setattr(stagewise.cli, "config_from_args", lambda args: pytest.fail("the model was resolved"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = _one_sentence_error(capsys, ["serve", "--model", "demo", "--port", str(port)])
    assert f"Port {port} on 127.0.0.1 is not free" in err and "--port" in err


def test_pp_size_beyond_the_layer_count_is_refused_before_loading(capsys, no_loading):
    err = _one_sentence_error(capsys, ["generate", "--model", "demo", "--pp-size", "100"])
    assert "--pp-size 100 asks for more stages than the model's" in err and "use --pp-size" in err


def test_a_hugging_face_id_says_ids_are_not_fetched(capsys, no_loading):
    err = _one_sentence_error(capsys, ["generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    assert "looks like a Hugging Face model id" in err and "no --model for the default model" in err


def test_a_tp_size_that_cannot_split_the_model_names_the_sizes_that_can():
    import transformers as tf

    from stagewise.checkpoint.facts import facts_of_config
    from stagewise.cli import _check_tp_size
    # the default model's shape (SmolLM2-135M)
    hf = tf.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                        intermediate_size=1536, num_hidden_layers=30, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"^--tp-size 4 cannot split this model \(9 attention heads, 3 KV heads, "
                                         r"49152 vocabulary entries\); use --tp-size 1, 2, 3 or 6\.$"):
        _check_tp_size(facts_of_config(hf), 4)
    _check_tp_size(facts_of_config(hf), 3)


def test_the_memory_table_says_what_the_kv_column_is():
    from stagewise.planning.memory import MemoryPlan, format_memory_table
    plan = MemoryPlan(0, (0, 30), 2 << 30, 92 << 20, 0, 0, 33 << 20, 11520 << 20, 32769, 368640)
    assert format_memory_table([plan]).splitlines()[-1].startswith("KV MiB is each pool's ceiling")
