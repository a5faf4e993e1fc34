"""Tensor parallelism with real rank processes: every stage a group of two ranks gives the greedy
tokens of one process in fp32 (one KV head replicated over two ranks, chunked prefill, a prefix hit,
and a killed rank that rebuilds the pipeline with nothing lost; uneven heads and a tied head with TP x PP:
the same token ids and logprob bits, in float32 and bfloat16)."""
import os
import signal

import pytest

from stagewise import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 15)), [(7 * i) % 900 + 3 for i in range(37)], [5, 9, 11] * 6, list(range(400, 430))]
pytestmark = pytest.mark.slow


def tokens(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                                         use_tqdm=False)]


def one_process(model_dir):
    with LLM(model=str(model_dir), dtype="float32") as llm:
        return tokens(llm)


def test_tp2_one_kv_head_chunks_prefix_hits_and_a_killed_rank(llama_mqa_dir):
    expected = one_process(llama_mqa_dir)
    with LLM(model=str(llama_mqa_dir), dtype="float32", tp_size=2, chunked_prefill_size=16, block_size=4,
             max_pipeline_restarts=1, pipeline_spares=False) as llm:
        assert len(llm.engine.executor.procs) == 2
        assert tokens(llm) == expected
        assert tokens(llm, PROMPTS[1:2]) == expected[1:2]
        stats = llm.stats()
        assert stats["prefix_cache_hit_rate"] > 0
        assert 0 < stats["stage_tp_comm_s"][0] < stats["stage_busy_s"][0]
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)        # the stage's second rank
        assert tokens(llm) == expected
        assert llm.stats()["recovery"]["rebuilds"] == {"stage_died": 1}


def scored(llm) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_pp2_uneven_heads_tied_head(llama_uneven_dir, dtype):
    """9 q heads in 3 KV groups (the default model's shape): 3 + 6 q heads, 1 + 2 KV heads per stage;
    the same ids and logprob bits as one process (the gathered layers sum as one process does)."""
    with LLM(model=str(llama_uneven_dir), dtype=dtype) as llm:
        expected = scored(llm)
    with LLM(model=str(llama_uneven_dir), dtype=dtype, tp_size=2, pp_size=2) as llm:
        assert len(llm.engine.executor.procs) == 4
        assert scored(llm) == expected
