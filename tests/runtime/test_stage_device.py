"""A stage's device: asking for CUDA where none is visible is one sentence for the user, not a crash."""
from __future__ import annotations

import pytest
import torch

from stagewise.cli import main
from stagewise.config import EngineConfig
from stagewise.parallel.partition import StageInfo
from stagewise.runtime.setup import stage_device


def test_cuda_without_a_visible_device_says_use_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"no CUDA device is visible.*--device cpu"):
        stage_device(EngineConfig.from_kwargs(model="x", device="cuda"), StageInfo.single(2))


def test_generate_with_device_cuda_and_no_gpu_prints_one_line(llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code = main(["--log-level", "warning", "generate", "--model", str(llama_dir), "--device", "cuda",
                 "--max-tokens", "1", "--kv-cache-memory", "16MiB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "--device cpu" in err and "\n" not in err, err
