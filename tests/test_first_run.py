"""The first hour of a new user: the default answer, honest first-run numbers, early checks with
one-sentence errors (no model loads for the checks; the numbers use the demo model)."""
from __future__ import annotations

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
    assert capsys.readouterr().out.strip().endswith("(eager: every step, --prefill-graph auto)")
    assert _steps_text(10, 0, "auto") == "every step replayed its graph"
    assert _steps_text(7, 3, "auto").startswith("mixed: 3 of 10 steps ran eager")
