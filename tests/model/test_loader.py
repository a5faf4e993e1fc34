"""Loader and stage structure: global layer ids, placeholders, stage-only reads, sharded
checkpoints, dtype resolution and the errors a broken checkpoint directory gets."""
from __future__ import annotations

import json
import shutil

import pytest
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from stagewise.checkpoint.facts import read_facts
from stagewise.kernels.gemm import pack
from stagewise.model.layers import StagePlaceholder
from stagewise.model.loader import load_model, resolve_dtype
from stagewise.parallel.partition import StageInfo, stage_infos


def _stages(model_dir, pp_size):
    n = read_facts(model_dir).num_layers
    return [load_model(model_dir, info, torch.float32) for info in stage_infos(n, pp_size)]


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_stage_layout_keeps_global_ids(llama_dir):
    model = load_model(llama_dir, StageInfo(rank=1, size=3, start=1, end=2, num_layers=4), torch.float32)
    assert len(model.layers) == 4
    for i, layer in enumerate(model.layers):
        if i == 1:
            assert layer.layer_id == 1 and layer.self_attn.layer_id == 1
        else:
            assert isinstance(layer, StagePlaceholder) and not list(layer.parameters())
    assert model.embed_tokens is None and model.lm_head is None and model.norm is None


def test_loaded_model_is_eval_and_frozen(family_dir):
    model = load_model(family_dir, StageInfo.single(read_facts(family_dir).num_layers), "auto")
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_stage_parameters_sum_to_whole(family_dir):
    whole = _num_params(_stages(family_dir, 1)[0])
    split = _stages(family_dir, 2)
    config = read_facts(family_dir).hf
    tied = bool(getattr(config, "tie_word_embeddings", False))
    duplicate = config.vocab_size * config.hidden_size if tied else 0  # the last stage's copy of the embedding
    assert sum(_num_params(m) for m in split) == whole + duplicate


def test_each_stage_reads_only_its_tensors(llama_dir, monkeypatch):
    read: list[str] = []

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)   # the loader imports it when it loads
    load_model(llama_dir, stage_infos(4, 2)[1], torch.float32)
    assert read and all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head."))
                        for n in read)
    assert "lm_head.weight" in read and "model.norm.weight" in read


def test_tied_head_on_last_stage_loads_embedding(llama_tied_dir):
    first, last = _stages(llama_tied_dir, 2)
    assert first.is_stage_weight("model.embed_tokens.weight")
    assert last.is_stage_weight("model.embed_tokens.weight") and not last.is_stage_weight("lm_head.weight")
    assert not first.is_stage_weight("model.norm.weight") and last.is_stage_weight("model.norm.weight")
    embedding = first.embed_tokens.weight            # the head holds it packed where the fp32 kernel packs
    expected = pack(embedding) if getattr(last.lm_head, "packed", False) else embedding   # N = 1000 (AVX2)
    assert torch.equal(last.lm_head.weight, expected)


def test_is_stage_weight_by_layer(qwen3_dir):
    first, last = _stages(qwen3_dir, 2)
    assert first.is_stage_weight("model.layers.1.self_attn.q_norm.weight")
    assert not first.is_stage_weight("model.layers.2.self_attn.q_norm.weight")
    assert last.is_stage_weight("model.layers.3.mlp.up_proj.weight")
    assert not last.is_stage_weight("model.embed_tokens.weight")
    assert not first.is_stage_weight("model.layers.0.self_attn.rotary_emb.inv_freq")  # legacy buffer, ignored


def test_sharded_checkpoint_loads(sharded_llama_dir, llama_dir, eager_pipeline):
    assert (sharded_llama_dir / "model.safetensors.index.json").exists()
    assert len(list(sharded_llama_dir.glob("model-*.safetensors"))) > 2
    ids = [4, 8, 15, 16, 23, 42]
    expected = eager_pipeline(llama_dir).prefill_logits(ids)
    assert torch.equal(eager_pipeline(sharded_llama_dir, pp_size=2).prefill_logits(ids), expected)


@pytest.fixture()
def broken_llama(tmp_path, llama_dir):
    """A writable copy of the tiny llama checkpoint."""
    path = tmp_path / "ckpt"
    shutil.copytree(llama_dir, path)
    return path


def _rewrite_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(broken_llama):
    _rewrite_weights(broken_llama, lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*missing"):
        load_model(broken_llama, StageInfo.single(4), torch.float32)
    load_model(broken_llama, stage_infos(4, 2)[0], torch.float32)  # stage 0 never needs layer 3


def test_bad_shape_names_tensor_and_shapes(broken_llama):
    _rewrite_weights(broken_llama, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match=r"k_proj\.weight.*model\.safetensors.*\(16, 64\).*\(32, 64\)"):
        load_model(broken_llama, StageInfo.single(4), torch.float32)


def test_unknown_architecture(broken_llama):
    config = json.loads((broken_llama / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (broken_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*LlamaForCausalLM"):
        load_model(broken_llama, StageInfo.single(4), torch.float32)


@pytest.mark.parametrize("remove", ["model.safetensors", "config.json", None])
def test_missing_files_say_what_is_needed(broken_llama, remove):
    target = broken_llama / "nowhere" if remove is None else broken_llama
    if remove:
        (broken_llama / remove).unlink()
    with pytest.raises(ValueError, match=r"(does not exist|neither).*must contain config\.json") as info:
        load_model(target, StageInfo.single(4), torch.float32)
    assert isinstance(info.value, FileNotFoundError)
    assert (remove or "nowhere") in str(info.value)


def test_missing_shard_is_named(tmp_path, sharded_llama_dir):
    path = tmp_path / "sharded"
    shutil.copytree(sharded_llama_dir, path)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_model(path, StageInfo.single(4), torch.float32)


def test_stage_for_wrong_layer_count(llama_dir):
    with pytest.raises(ValueError, match="planned for 6 layers"):
        load_model(llama_dir, StageInfo.single(6), torch.float32)


def test_resolve_dtype(llama_dir):
    config = read_facts(llama_dir).hf
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    config.dtype = torch.bfloat16
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", config, "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, config, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", config, "cpu")


def test_bfloat16_load(llama_dir):
    model = load_model(llama_dir, StageInfo.single(4), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_full.dtype == torch.float32


def test_old_style_rope_config_loads_the_same(broken_llama, llama_dir, eager_pipeline):
    """A pre-transformers-5 config.json (`rope_theta` + `rope_scaling`) gives the same model."""
    config = json.loads((broken_llama / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (broken_llama / "config.json").write_text(json.dumps(config))
    ids = [7, 70, 700, 17, 170]
    assert torch.equal(eager_pipeline(broken_llama).prefill_logits(ids), eager_pipeline(llama_dir).prefill_logits(ids))
