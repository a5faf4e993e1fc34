"""`ModelFacts`: one record per checkpoint, read once, with the shapes transformers' own config
reports (the oracle), layer kinds, and each layer's bytes as stored in the file."""
import ast
import json
import shutil
from pathlib import Path

import pytest
import transformers as tf
from safetensors.torch import load_file

from stagewise.checkpoint.facts import facts_of_config, read_facts

SRC = Path(__file__).resolve().parents[2] / "src" / "stagewise"


def test_shapes_are_transformers_own(family_dir):
    facts = read_facts(family_dir)
    hf = tf.AutoConfig.from_pretrained(family_dir)
    text = hf.get_text_config()
    assert facts.num_layers == text.num_hidden_layers
    assert facts.hidden == text.hidden_size and facts.vocab == text.vocab_size
    assert facts.heads == text.num_attention_heads
    assert facts.kv_heads == (getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    assert facts.max_positions == text.max_position_embeddings
    assert facts.tie_embeddings == bool(text.tie_word_embeddings)
    assert facts.architecture == hf.architectures[0] and facts.gguf is None and facts.quantized_as is None


def test_stored_bytes_are_the_files_tensors_per_layer(llama_dir):
    facts = read_facts(llama_dir)
    tensors = load_file(str(llama_dir / "model.safetensors"))
    per_layer = [sum(t.numel() * t.element_size() for name, t in tensors.items() if f".layers.{i}." in name)
                 for i in range(facts.num_layers)]
    assert [layer.stored_bytes for layer in facts.layers] == per_layer and min(per_layer) > 0
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert facts.other_bytes == total - sum(per_layer) > 0
    assert facts.layer_kinds == ("decoder",) * facts.num_layers


def test_a_gguf_file_has_the_same_shapes_and_its_quantized_bytes(llama_dir, tiny_gguf):
    path = tiny_gguf("llama", "Q8_0")
    facts, hf_facts = read_facts(path), read_facts(llama_dir)
    for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
        assert getattr(facts, name) == getattr(hf_facts, name), name
    assert facts.gguf == str(path) and facts.quantized_as == "Q8_0" and facts.stored_dtype is None
    # Q8_0 holds 34 bytes per 32 weights: a layer's matrices shrink to about 34/128 of float32
    ratio = facts.layers[0].stored_bytes / hf_facts.layers[0].stored_bytes
    assert 0.2 < ratio < 0.4, ratio
    assert facts.eos_token_ids


def test_facts_are_read_once_per_file_version(llama_dir, tmp_path):
    assert read_facts(llama_dir) is read_facts(str(llama_dir))
    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    before = read_facts(copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 77}))   # rewritten in place
    assert before.max_positions != 77 and read_facts(copy).max_positions == 77


def test_layer_kinds_follow_the_config():
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, vocab_size=256, architectures=["LlamaForCausalLM"])
    sliding = tf.LlamaConfig(**base)
    sliding.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert facts_of_config(sliding).layer_kinds == ("sliding_attention", "full_attention", "sliding_attention")
    moe = tf.LlamaConfig(**base)
    moe.num_local_experts = 8
    assert facts_of_config(moe).layer_kinds == ("moe",) * 3
    gpt2 = facts_of_config(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256))
    assert (gpt2.hidden, gpt2.num_layers, gpt2.heads, gpt2.kv_heads, gpt2.head_dim, gpt2.intermediate) == \
        (64, 2, 4, 4, 16, 256)
    with pytest.raises(ValueError, match="names no layer count"):
        facts_of_config(tf.LlamaConfig(**{**base, "num_hidden_layers": 0}))


def test_max_len_is_at_most_the_models_positions(llama_dir):
    facts = read_facts(llama_dir)
    assert facts.max_len(None) == facts.max_positions and facts.max_len(8) == 8
    with pytest.raises(ValueError, match="exceeds the model's"):
        facts.max_len(facts.max_positions + 1)


def test_only_the_facts_builder_reads_a_checkpoints_config():
    """config.json and GGUF metadata become a config in one place: everything else reads `ModelFacts`."""
    callers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("load_hf_config", "hf_config_from_gguf"):
                callers.append(str(path.relative_to(SRC)))
    assert sorted(set(callers)) == ["checkpoint/facts.py", "checkpoint/files.py"], callers
