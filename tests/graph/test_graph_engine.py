"""Prefill and decode graphs through the whole engine (`LLM`, real stage processes for PP>1):
graph runs give the tokens of the one-stage eager run, the driver's verdicts show in stats."""
import json
import shutil

import pytest
import torch

from stagewise import LLM, SamplingParams, register_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[(11 * i) % 900 + 3 for i in range(47)], list(range(10, 31)), [5], list(range(300, 309))]
GRAPHS = dict(prefill_graph="breakable", prefill_graph_buckets="8,24,48,64", decode_graph=True,
              decode_graph_max_bs=4)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def eager(model_dir, prompts=PROMPTS):
    with LLM(model=str(model_dir), prefill_graph="off") as llm:
        return tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))


def test_one_stage_graphs_verdicts_and_tokens(llama_dir):
    ref = eager(llama_dir)
    with LLM(model=str(llama_dir), **GRAPHS) as llm:
        first = llm.generate(prompt_token_ids=PROMPTS[:1], use_tqdm=False,
                             sampling_params=SamplingParams(max_tokens=1, temperature=0))
        assert llm.stats()["prefill_graph"]["replays"] == {48: 1}          # 47 tokens replay on bucket 48
        llm.generate(prompt_token_ids=[[7]], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
        stats = llm.stats()["prefill_graph"]
        assert stats["eager"] == {"padding": 1}                          # 1 token never pads to 8
        assert stats["backend"] == "breakable" and stats["buckets"] == [8, 24, 48, 64]
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        decode = llm.stats()["decode_graph"]
    assert first[0].outputs[0].token_ids == ref[0][:1]
    assert got == ref
    assert sum(decode["replays"].values()) > 0 and decode["padded_tokens"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("family,pp,extra", [("llama", 2, dict(chunked_prefill_size=24)),
                                             ("gpt2", 3, dict(prefill_graph="full", chunked_prefill_size=40))])
def test_pipeline_graphs_equal_one_stage_eager(request, family, pp, extra):
    model_dir = request.getfixturevalue(f"{family}_dir")
    ref = eager(model_dir)
    with LLM(model=str(model_dir), pp_size=pp, **{**GRAPHS, **extra}) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        stats = llm.stats()
    assert got == ref
    assert sum(stats["prefill_graph"]["replays"].values()) > 0
    assert sum(stats["decode_graph"]["replays"].values()) > 0


def test_embeddings_under_graphs_equal_eager(llama_dir):
    from safetensors import safe_open
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    embeds = [table[torch.tensor(p)] for p in PROMPTS[:2]]
    ref = eager(llama_dir, PROMPTS[:2])
    with LLM(model=str(llama_dir), chunked_prefill_size=32, **GRAPHS) as llm:
        got = tokens(llm.generate(input_embeds=embeds, sampling_params=GREEDY, use_tqdm=False))
        assert llm.stats()["prefill_graph"]["replays"]
    assert got == ref


@pytest.mark.slow
def test_registered_model_with_other_signature_under_pp2_graphs(llama_dir, tmp_path):
    from odd_signature_model import OddLlamaForCausalLM
    odd_dir = tmp_path / "odd"
    shutil.copytree(llama_dir, odd_dir)
    cfg = json.loads((odd_dir / "config.json").read_text())
    cfg["architectures"] = ["OddLlamaForCausalLM"]
    (odd_dir / "config.json").write_text(json.dumps(cfg))
    register_model("OddLlamaForCausalLM", OddLlamaForCausalLM)
    ref = eager(llama_dir, PROMPTS[:2])
    with LLM(model=str(odd_dir), pp_size=2, chunked_prefill_size=48, **GRAPHS) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False))
        assert llm.stats()["prefill_graph"]["replays"]
    assert got == ref
