"""The demo checkpoint: builds offline, loads with AutoTokenizer (chat template included) and
with the stagewise loader, and gives finite logits."""
from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

from stagewise.checkpoint.facts import read_facts
from stagewise.model.demo import build_demo_model, default_demo_dir, ensure_demo_model
from stagewise.model.loader import load_model
from stagewise.parallel.partition import StageInfo


def test_demo_model_builds_and_runs(tmp_path, eager_pipeline):
    path = build_demo_model(tmp_path / "demo")
    tok = AutoTokenizer.from_pretrained(path)
    config = read_facts(path).hf
    assert config.vocab_size == len(tok) and config.num_hidden_layers == 4
    assert config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|eos|>")
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == config.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How is the weather?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|><|system|>") and text.endswith("<|assistant|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    logits = eager_pipeline(path).prefill_logits(ids)
    assert logits.shape == (len(ids), len(tok)) and torch.isfinite(logits).all()
    assert len(set(eager_pipeline(path).greedy(ids, 8))) > 1  # not a degenerate constant model


def test_demo_model_is_seeded(tmp_path):
    a = load_model(build_demo_model(tmp_path / "a", seed=3), StageInfo.single(4), torch.float32)
    b = load_model(build_demo_model(tmp_path / "b", seed=3), StageInfo.single(4), torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_ensure_demo_model_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "cache"))
    assert default_demo_dir() == tmp_path / "cache" / "demo-model"
    path = ensure_demo_model()
    assert path == default_demo_dir() and (path / "config.json").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == ["demo-model"]  # no temp dirs left behind
