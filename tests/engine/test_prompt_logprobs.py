"""Prompt logprobs equal HF's log_softmax on the same weights for every prompt position: at one
stage and two, with chunked prefill, a prefix-cache hit on part of the prompt, and graphs on."""
import pytest
import torch

from stagewise import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 900 + 10 for i in range(41)]
TOP = 3


@pytest.fixture(scope="module")
def hf_lp(llama_dir, hf_logits):
    return hf_logits(llama_dir, PROMPT).log_softmax(-1)      # [T, V]: row i predicts token i + 1


def check(out, hf_lp):
    entries = out.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == PROMPT[i]
        assert abs(e.logprob - float(hf_lp[i - 1, PROMPT[i]])) < 1e-4, i
        assert list(e.top) == hf_lp[i - 1].topk(TOP).indices.tolist()
        assert torch.allclose(torch.tensor(list(e.top.values())), hf_lp[i - 1].topk(TOP).values, atol=1e-4)


def generate(llm, **params):
    sp = SamplingParams(max_tokens=params.pop("max_tokens", 2), temperature=0, prompt_logprobs=TOP, **params)
    return llm.generate(prompt_token_ids=[PROMPT], sampling_params=sp, use_tqdm=False)[0]


def test_one_stage_chunked_and_after_a_prefix_hit(llama_dir, hf_lp):
    with LLM(model=str(llama_dir), chunked_prefill_size=16) as llm:       # 41 tokens: three chunks
        check(generate(llm), hf_lp)
        plain = llm.generate(prompt_token_ids=[PROMPT[:35]], sampling_params=SamplingParams(max_tokens=1),
                             use_tqdm=False)[0]
        assert plain.prompt_logprobs is None
        again = generate(llm)                # its first 32 tokens are cached, but their rows are needed
        check(again, hf_lp)
        scored = generate(llm, max_tokens=0)
        assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
        check(scored, hf_lp)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate(input_embeds=[torch.zeros(3, 64)], sampling_params=SamplingParams(prompt_logprobs=1),
                         use_tqdm=False)


@pytest.mark.slow
def test_two_stages_with_graphs(llama_dir, hf_lp):
    with LLM(model=str(llama_dir), pp_size=2, chunked_prefill_size=24, prefill_graph="breakable",
             prefill_graph_buckets=[8, 24]) as llm:
        out = generate(llm)
        assert llm.stats()["prefill_graph"]["replays"]
    check(out, hf_lp)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_score_sums_the_continuation_logprobs(llama_dir, hf_logits):
    with LLM(model=str(llama_dir)) as llm:
        tok = llm.engine.tok
        got = llm.score(["The cat sat", "Once upon"], [" on the mat", " a time"])
        for (p, c), value in zip([("The cat sat", " on the mat"), ("Once upon", " a time")], got):
            ids, n = tok.encode(p) + tok.encode(c), len(tok.encode(p))
            lp = hf_logits(llama_dir, ids).log_softmax(-1)
            assert abs(value - sum(float(lp[i - 1, ids[i]]) for i in range(n, len(ids)))) < 1e-3
