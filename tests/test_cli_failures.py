"""`stagewise bench` and `generate` exit non-zero when requests failed: a model whose LM head is
NaN fails every request (non-finite logits), which must not pass for a measurement or an answer."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagewise.cli import main


@pytest.fixture(scope="module")
def nan_head_dir(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("nan-head")
    for f in llama_dir.iterdir():
        shutil.copy(f, path / f.name)
    weights = load_file(str(llama_dir / "model.safetensors"))
    weights["lm_head.weight"] = torch.full_like(weights["lm_head.weight"], float("nan"))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


BENCH = ["--log-level", "WARNING", "bench", "--num-requests", "3", "--prompt-len", "8", "--output-len", "2",
         "--dtype", "float32", "--model"]


def test_bench_exits_non_zero_when_requests_fail(nan_head_dir, llama_dir, capsys):
    assert main([*BENCH, str(nan_head_dir)]) == 1
    err = capsys.readouterr().err
    assert "3 of 3 requests failed" in err and "non-finite logits" in err
    assert main([*BENCH, str(llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "3 requests, 6 output tokens" in out and "time to first token" in out


def test_generate_exits_non_zero_when_a_prompt_fails(nan_head_dir, llama_dir, capsys):
    args = ["--log-level", "WARNING", "generate", "--no-chat", "--max-tokens", "2", "--dtype", "float32",
            "--prompt", "hello", "--model"]
    assert main([*args, str(nan_head_dir)]) == 1
    assert "1 of 1 prompt(s) failed" in capsys.readouterr().err
    assert main([*args, str(llama_dir)]) == 0
