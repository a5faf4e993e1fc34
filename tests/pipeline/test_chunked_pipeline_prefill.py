"""Chunked pipeline prefill: the chunks of one long prompt flow through the stages concurrently (the
driver books chunk k+1 into the next plan while chunk k is still on a later stage: a non-final chunk
needs no sampled token), and the tokens and logprobs are exactly those of the one-process eager run
with the same chunks."""
import pytest

from stagewise import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = [(7 * i) % 900 + 3 for i in range(200)]        # 13 chunks of 16 tokens (the last 8)
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
OPTIONS = dict(chunked_prefill_size=16, block_size=4, enable_prefix_caching=False, dtype="float32")


def run(model_dir, **options):
    with LLM(model=str(model_dir), **OPTIONS, **options) as llm:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS, use_tqdm=False)[0]
        return out, llm.stats()


def test_chunks_of_one_prompt_overlap_across_stages_and_match_one_process(llama_dir):
    want, one = run(llama_dir)
    got, two = run(llama_dir, pp_size=2)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs == want.outputs[0].logprobs
    assert got.prompt_logprobs == want.prompt_logprobs
    # one process: one plan at a time; two stages: the next chunk rode along with every earlier one
    assert (one["max_plans_per_request"], one["prefill_chunks_overlapped"]) == (1, 0)
    assert two["max_plans_per_request"] == 2
    assert two["prefill_chunks_overlapped"] == 12          # every chunk but the first
