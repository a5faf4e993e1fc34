"""End to end through `LLM`: HF parity per family, and every scheduling feature (continuous
batching, chunked prefill, prefix caching, preemption) against one-request-at-a-time runs."""
import pytest
import torch

from stagewise import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 15)), [(7 * i) % 900 + 3 for i in range(37)], list(range(200, 221)),
           [5, 9, 11] * 6]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_hf_for_every_family(family_dir, hf_greedy):
    with LLM(model=str(family_dir)) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=GREEDY, use_tqdm=False))
    assert got == hf_greedy(family_dir, PROMPTS[:3], 32)


@pytest.fixture(scope="module")
def one_at_a_time(llama_dir):
    with LLM(model=str(llama_dir), max_num_seqs=1, enable_prefix_caching=False, chunked_prefill_size=512) as llm:
        return [tokens(llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False))[0]
                for p in PROMPTS]


@pytest.mark.parametrize("options", [
    dict(),                                                  # continuous batching, everything at once
    dict(chunked_prefill_size=8),                            # prompts split into chunks, mixed with decodes
    dict(chunked_prefill_size=16, block_size=4),
    dict(kv_cache_memory=28 * 4 * 2 * 4 * 2 * 16 * 4),       # ~28 blocks: forces preemption
])
def test_scheduling_features_keep_tokens(llama_dir, one_at_a_time, options):
    with LLM(model=str(llama_dir), **options) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        stats = llm.stats()
    assert got == one_at_a_time
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0


def test_prefix_cache_is_used_and_exact(llama_dir, one_at_a_time):
    shared = PROMPTS[1]
    prompts = [shared + [1, 2, 3], shared + [4, 5], shared]
    with LLM(model=str(llama_dir), block_size=4) as llm:
        first = tokens(llm.generate(prompt_token_ids=[prompts[0]], sampling_params=GREEDY, use_tqdm=False))
        rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens >= 32 for o in rest)
        assert llm.stats()["prefix_cache_hit_rate"] > 0.5
    with LLM(model=str(llama_dir), enable_prefix_caching=False) as llm:
        ref = tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    assert first + tokens(rest) == ref
    assert ref[2] == one_at_a_time[1]


def test_input_embeds_equal_ids(llama_dir):
    from safetensors import safe_open
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    with LLM(model=str(llama_dir)) as llm:
        by_ids = tokens(llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False))
        embeds = [table[torch.tensor(p)] for p in PROMPTS[:2]]
        by_embeds = tokens(llm.generate(input_embeds=embeds, sampling_params=GREEDY, use_tqdm=False))
    assert by_embeds == by_ids


def test_seeded_sampling_reproducible_and_stop_strings(llama_dir):
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    with LLM(model=str(llama_dir)) as llm:
        a, b, c = tokens(llm.generate(prompt_token_ids=[PROMPTS[0]] * 3, sampling_params=params, use_tqdm=False))
        again = tokens(llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params[0], use_tqdm=False))[0]
        assert a == b == again and a != c
        full = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0]
        stop = full.text[10:13]
        cut = llm.generate(prompt_token_ids=[PROMPTS[1]], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=32, temperature=0, stop=[stop], ignore_eos=True))
        out = cut[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index(stop)]


def test_bad_input_fails_alone(llama_dir):
    with LLM(model=str(llama_dir), max_model_len=64) as llm:
        outs = llm.generate(prompt_token_ids=[PROMPTS[0], list(range(100)), PROMPTS[2]],
                            sampling_params=SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert outs[1].outputs[0].finish_reason == "error" and "context" in outs[1].outputs[0].error
        assert [len(o.outputs[0].token_ids) > 0 for o in outs] == [True, False, True]
        assert len(llm.generate(prompt_token_ids=[list(range(40))], use_tqdm=False,
                                sampling_params=SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
                                )[0].outputs[0].token_ids) == 24           # clipped by the context
        for bad in ([""], [3], "x" and [["a"]]):
            with pytest.raises(ValueError):
                llm.generate(bad, use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(prompt_token_ids=[[5, 10**6]], use_tqdm=False)
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate(["hi", "there"], [SamplingParams()], use_tqdm=False)
        assert llm.generate(["still serving"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_text_prompts_and_chat(llama_dir):
    with LLM(model=str(llama_dir)) as llm:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        out = llm.generate("Hello world", params, use_tqdm=False)[0]
        assert out.prompt == "Hello world" and out.prompt_token_ids == llm.tokenizer.encode("Hello world")
        assert len(out.outputs[0].token_ids) == 5 and isinstance(out.outputs[0].text, str)
        chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))
        assert len(chat) == 1 and chat[0].outputs[0].token_ids


def test_request_larger_than_the_kv_cache_stops_instead_of_hanging(llama_dir):
    with LLM(model=str(llama_dir), kv_cache_memory=5 * 4 * 2 * 2 * 16 * 16 * 4) as llm:   # 5 blocks of 16
        out = llm.generate(prompt_token_ids=[list(range(10, 20))], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))[0]
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 64 - 10
        too_long = llm.generate(prompt_token_ids=[list(range(10, 80))], use_tqdm=False)[0].outputs[0]
        assert too_long.finish_reason == "error" and "KV cache" in too_long.error
