"""The demo model: a tiny, seeded, random-weight Llama checkpoint with a real byte-level BPE
tokenizer and chat template, written as a standard HF directory so every path of the engine
(loader, tokenizer, chat, server) runs offline. Also the tokenizer builder the tests reuse.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig

from stagewise.config import cache_root
from stagewise.model.llama import LlamaForCausalLM
from stagewise.parallel.partition import StageInfo

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0..5 in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
DEMO_VOCAB_SIZE = 2048


def _corpus() -> str:
    return resources.files("stagewise.model").joinpath("demo_corpus.txt").read_text(encoding="utf-8")


def build_test_tokenizer(out_dir: str | Path, vocab_size: int, max_length: int = 2048) -> int:
    """Train a byte-level BPE on the shipped corpus; write tokenizer.json + tokenizer_config.json.

    Returns the vocabulary size reached (at most `vocab_size`; the corpus allows about 2500).
    No bos is added automatically: the chat template writes it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus().split("\n\n"), trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": PAD, "additional_special_tokens": SPECIAL_TOKENS[3:], "chat_template": CHAT_TEMPLATE,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": SPECIAL_TOKENS[3:]},
        indent=2))
    return tok.get_vocab_size()


def demo_config(vocab_size: int) -> LlamaConfig:
    ids: dict[str, Any] = {name: SPECIAL_TOKENS.index(tok) for name, tok in
           (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD))}
    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
                       dtype="float32", **ids)


def _random_weights(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded tensors named and shaped as the HF checkpoint; std 0.1 keeps greedy argmaxes well apart."""
    with torch.device("meta"):
        shapes = {name: slot.shape for name, slot in
                  LlamaForCausalLM(config, StageInfo.single(config.num_hidden_layers), torch.float32)
                  .weight_table().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen)
        tensors[name] = (1.0 + 0.1 * noise) if name.endswith("norm.weight") else 0.1 * noise
    return tensors


def build_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint (config, weights, generation config, tokenizer) into `out_dir`."""
    out = Path(out_dir)
    vocab = build_test_tokenizer(out, DEMO_VOCAB_SIZE)
    config = demo_config(vocab)
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, max_new_tokens=64).save_pretrained(out)
    save_file(_random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def default_demo_dir() -> Path:
    """`$STAGEWISE_CACHE/demo-model`, else `~/.cache/stagewise/demo-model`."""
    return cache_root() / "demo-model"


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """Build the demo model once; concurrent callers are safe (build in a temp dir, then rename)."""
    target = Path(path) if path is not None else default_demo_dir()
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        build_demo_model(tmp)
        os.rename(tmp, target)
    except OSError:
        # Another process finished first (rename onto a non-empty dir fails); keep theirs.
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
