"""vLLM's request extensions in the engine: the logits processors (logit_bias, allowed_token_ids,
bad_words) on the sampling stage, alone and under PP=2 with graphs and seeds (the one-stage eager
run is the oracle), include_stop_str_in_output, truncate_prompt_tokens, and cache_salt (requests
with different salts share no prefix blocks, and report cached tokens of their own salt only)."""
from __future__ import annotations

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.runtime.sampler import NO_TOKEN_LEFT, Sampler, apply_logits_processors


class Row:
    def __init__(self, params: SamplingParams, token_ids=(1, 2, 3), num_prompt_tokens: int = 3):
        self.params, self.token_ids, self.num_prompt_tokens = params, list(token_ids), num_prompt_tokens
        self.input_embeds = None


def test_rows_without_processors_pay_nothing():
    logits = torch.randn(3, 50)
    before = logits.clone()
    assert apply_logits_processors(logits, [Row(SamplingParams(temperature=0))] * 3) == [True] * 3
    assert torch.equal(logits, before)
    plain, biased = Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=0, logit_bias={1: 1.0}))
    assert Sampler()._is_plain_greedy(plain) and not Sampler()._is_plain_greedy(biased)


def test_each_processor_changes_only_its_row():
    logits = torch.zeros(4, 50)
    logits[:, 9] = 5.0                                       # every row's favourite: token 9
    bad = SamplingParams(temperature=0, bad_words=["x"])
    bad.bad_words_token_ids = [[9], [3, 4]]                  # as the engine sets it from its tokenizer
    rows = [Row(SamplingParams(temperature=0)),
            Row(SamplingParams(temperature=0, logit_bias={7: 100.0})),
            Row(SamplingParams(temperature=0, allowed_token_ids=[11, 12])),
            Row(bad, token_ids=[1, 2, 3, 3], num_prompt_tokens=3)]   # output [3]: 4 is banned after it
    logits[3, 4] = 4.0
    draws = Sampler().sample(logits, rows)
    assert [d.token for d in draws[:3]] == [9, 7, 11]
    assert draws[3].token not in (9, 4)
    assert logits[1, 7] == 0 and logits[2, 0] == 0           # the raw logits are untouched (logprobs read them)


def test_a_row_left_without_tokens_fails_alone():
    logits = torch.randn(2, 20)
    rows = [Row(SamplingParams(allowed_token_ids=[5], bad_words=["q"])), Row(SamplingParams(seed=1))]
    rows[0].params.bad_words_token_ids = [[5]]
    draws = Sampler().sample(logits, rows)
    assert draws[0].token is None and draws[0].error == NO_TOKEN_LEFT
    assert draws[1].token is not None


def test_seeded_draws_stay_inside_allowed_tokens():
    allowed = [2, 3, 5, 7, 11]
    params = SamplingParams(seed=7, allowed_token_ids=allowed, logit_bias={3: -100.0})
    picks = [Sampler().sample(torch.randn(1, 40), [Row(params, token_ids=[1] * (3 + k))])[0].token for k in range(40)]
    assert set(picks) <= set(allowed) - {3} and len(set(picks)) > 1


def _constrained(tok) -> list[SamplingParams]:
    word = tok.decode(tok.encode(" hello")).strip() or "hello"
    return [SamplingParams(max_tokens=12, temperature=0.9, seed=11 + i, ignore_eos=True,
                           allowed_token_ids=list(range(100, 160)), logit_bias={120: 3.0, 130: -100.0},
                           bad_words=[word, "ab"])
            for i in range(3)] + [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={42: 100.0})]


PROMPTS = [[(5 * i) % 700 + 3 for i in range(23)], list(range(40, 49)), [7, 8, 9] * 4, list(range(300, 333))]


def _run(llm: LLM):
    params = _constrained(llm.engine.tok)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], params


@pytest.fixture(scope="module")
def eager_one_stage(llama_dir):
    with LLM(model=str(llama_dir), prefill_graph="off") as llm:
        return _run(llm)


def test_processors_hold_in_the_engine(eager_one_stage):
    tokens, params = eager_one_stage
    for toks, p in zip(tokens[:3], params[:3]):
        assert len(toks) == 12 and set(toks) <= set(range(100, 160)) - {130}
        for seq in p.bad_words_token_ids or []:
            assert all(toks[k:k + len(seq)] != seq for k in range(len(toks)))
    assert tokens[3] == [42] * 12
    assert len({tuple(t) for t in tokens[:3]}) == 3          # three seeds, three draws


@pytest.mark.slow
def test_processors_under_pp_with_graphs_equal_one_stage_eager(llama_dir, eager_one_stage):
    with LLM(model=str(llama_dir), pp_size=2, prefill_graph="breakable", decode_graph=True,
             chunked_prefill_size=16) as llm:
        got, _ = _run(llm)
        stats = llm.stats()
    assert got == eager_one_stage[0]
    assert sum(stats["prefill_graph"]["replays"].values()) > 0 and sum(stats["decode_graph"]["replays"].values()) > 0


def test_processors_hold_under_speculative_decoding(llama_dir, eager_one_stage):
    """Every verified draft row is sampled with its request's processors, so speculation changes no token."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(model=str(llama_dir), prefill_graph="off", speculative_config=spec) as llm:
        got, _ = _run(llm)
        accepted = llm.stats()["speculative"]["accepted"]
    assert got == eager_one_stage[0]
    assert accepted > 0                 # the forced [42] * 12 row is all drafts after its first tokens


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(model=str(llama_dir), block_size=4) as engine:
        yield engine


def test_include_stop_str_and_truncate_prompt_tokens(llm):
    ids = list(range(60, 80))
    free = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=12, temperature=0,
                                                                                  ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[3:6]
    assert len(stop) == 3 and text.find(stop) == 3
    kept, cut = (llm.generate(prompt_token_ids=[ids], use_tqdm=False, sampling_params=SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep))[0]
        for keep in (True, False))
    assert kept.outputs[0].text == text[:6] and cut.outputs[0].text == text[:3]
    short = llm.generate(prompt_token_ids=[[1, 2, 3] + ids[-8:], ids[-8:]], use_tqdm=False, sampling_params=[
        SamplingParams(max_tokens=6, temperature=0, truncate_prompt_tokens=8), SamplingParams(max_tokens=6,
                                                                                             temperature=0)])
    assert short[0].prompt_token_ids == ids[-8:]
    assert short[0].outputs[0].token_ids == short[1].outputs[0].token_ids


def test_different_salts_share_no_prefix_blocks(llm):
    engine, prompt = llm.engine, [(11 * i) % 900 + 2 for i in range(30)]

    def run(salt):
        req = engine.add_request(params=SamplingParams(max_tokens=2, temperature=0, cache_salt=salt),
                                 prompt_token_ids=prompt)
        blocks = set()
        for _ in engine.run_until_done():
            blocks |= set(req.block_ids)
        return req, blocks

    first, first_blocks = run("tenant-a")
    other, other_blocks = run("tenant-b")
    unsalted, unsalted_blocks = run(None)
    same, same_blocks = run("tenant-a")
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert not other_blocks & first_blocks and not unsalted_blocks & (first_blocks | other_blocks)
    assert same.num_cached_tokens == 28 and len(same_blocks & first_blocks) == 7    # its own salt: shared
