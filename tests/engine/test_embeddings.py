"""Embeddings (SamplingParams.embed, LLM.embed) equal transformers' last hidden state after the final
norm, pooled (last token or mean) and L2-normalised: at one stage with chunked prefill, at two stages,
batched with a generation request, with the pooling a sentence-transformers config names."""
import functools
import json
import shutil

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.checkpoint.pooling import checkpoint_pooling

PROMPTS = [[(7 * i + 3) % 900 + 10 for i in range(41)], [(5 * i + 1) % 900 + 10 for i in range(9)], [42]]


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_embedding(model_dir, ids: list[int], pooling: str) -> torch.Tensor:
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()   # after the final norm
    vec = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=0)


def check(vectors, model_dir, pooling: str, prompts=PROMPTS):
    assert len(vectors) == len(prompts)
    for vec, ids in zip(vectors, prompts):
        want = hf_embedding(model_dir, ids, pooling)
        got = torch.tensor(vec)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5), (pooling, (got - want).abs().max())
        assert abs(float(got.norm()) - 1.0) < 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_one_stage_chunked(llama_dir, pooling):
    with LLM(model=str(llama_dir), pooling=pooling, chunked_prefill_size=16) as llm:    # 41 tokens: three chunks
        check(llm.embed(prompt_token_ids=PROMPTS), llama_dir, pooling)
        again = llm.embed(prompt_token_ids=PROMPTS[:1])       # no prefix-cache hit skips rows mean pooling needs
        check(again, llama_dir, pooling, PROMPTS[:1])
        blocks = llm.engine.scheduler.blocks       # every block back in the pool, none offered to the prefix cache
        assert len(blocks.free) == blocks.num_blocks - 1 and not blocks.block_of


def test_batched_with_generation(llama_dir, hf_greedy):
    """One plan holds an embedding prompt and a generation request; each gets its own answer."""
    with LLM(model=str(llama_dir), pooling="mean") as llm:
        scheduler, plans = llm.engine.scheduler, []
        update = scheduler.update

        def seen(plan, result):        # records which requests each plan carried
            plans.append({s.request_id for s in plan.seqs})
            return update(plan, result)
        scheduler.update = seen
        gen = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        emb = SamplingParams(max_tokens=0, embed=True)
        outs = llm.generate(prompt_token_ids=[PROMPTS[1], PROMPTS[0]], sampling_params=[gen, emb], use_tqdm=False)
        with pytest.raises(ValueError, match="context"):
            llm.embed(prompt_token_ids=[[5] * 5000])
        with pytest.raises(ValueError, match="empty"):
            llm.embed([])
    assert {outs[0].request_id, outs[1].request_id} in plans
    assert outs[0].embedding is None
    assert outs[0].outputs[0].token_ids == hf_greedy(llama_dir, [PROMPTS[1]], 4)[0]
    assert outs[1].outputs[0].token_ids == [] and outs[1].outputs[0].finish_reason == "stop"
    check([outs[1].embedding], llama_dir, "mean", PROMPTS[:1])


@pytest.mark.slow
def test_two_stages(llama_dir, hf_greedy):
    """Two stage processes: last-token pooling (auto), and mean pooling over chunks in plans shared
    with a generation request."""
    with LLM(model=str(llama_dir), pp_size=2, chunked_prefill_size=16) as llm:
        check(llm.embed(prompt_token_ids=PROMPTS), llama_dir, "last")
    with LLM(model=str(llama_dir), pp_size=2, chunked_prefill_size=16, pooling="mean") as llm:
        gen = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        emb = SamplingParams(max_tokens=0, embed=True)
        outs = llm.generate(prompt_token_ids=[PROMPTS[1], PROMPTS[0]], sampling_params=[gen, emb], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(llama_dir, [PROMPTS[1]], 3)[0]
    check([outs[1].embedding], llama_dir, "mean", PROMPTS[:1])


def test_sentence_transformers_pooling_config(tmp_path, llama_dir):
    model = tmp_path / "st"
    shutil.copytree(llama_dir, model)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
              "pooling_mode_lasttoken": False}
    (model / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert checkpoint_pooling(model) == "mean"
    with LLM(model=str(model)) as llm:
        check(llm.embed(prompt_token_ids=PROMPTS[1:2]), llama_dir, "mean", PROMPTS[1:2])
    config["pooling_mode_cls_token"] = True
    (model / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--pooling"):
        checkpoint_pooling(model)


def test_embed_params_are_checked():
    SamplingParams(max_tokens=0, embed=True)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, embed=True, prompt_logprobs=1)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(max_tokens=0, embed=True, structured_outputs={"regex": "a+"})


def test_with_speculative_decoding(llama_dir):
    """A prompt whose final chunk is one token looks like a decode row to the n-gram proposer; an
    embedding request (here with max_tokens left at its default, which it ignores) gets no drafts,
    so its last row is pooled."""
    prompt = [5, 6, 7, 8] * 4 + [5]                 # 17 tokens: chunks of 16 and 1; the 5 repeats
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(model=str(llama_dir), chunked_prefill_size=16, speculative_config=spec) as llm:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(embed=True), use_tqdm=False)[0]
    check([out.embedding], llama_dir, "last", [prompt])
