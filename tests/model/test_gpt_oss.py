"""gpt-oss against HF transformers (fp32): attention sinks, window-8 sliding layers between full ones,
YaRN rope, biased router and experts with the clamped SwiGLU; prompt logits and greedy tokens at PP=1
and PP=2, a batch mixing fresh prompts, a continued prefill and decode rows; YaRN tables equal to
transformers' for other settings too."""
from __future__ import annotations

import pytest
import torch

from stagewise.model.attention import AttentionMetadata
from stagewise.model.layers import rope_attention_scaling, rope_inv_freq, rope_parameters

PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9))]  # 5, 17 and 45 tokens: the longer two pass the window of 8


@pytest.mark.parametrize("pp_size", [1, 2])
def test_logits_and_greedy_match_hf(gpt_oss_dir, eager_pipeline, hf_logits, hf_greedy, pp_size):
    pipe = eager_pipeline(gpt_oss_dir, pp_size=pp_size)
    for ids in PROMPTS:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(gpt_oss_dir, ids), atol=1e-4, rtol=0)
    assert [pipe.greedy(ids, 16) for ids in PROMPTS[1:]] == hf_greedy(gpt_oss_dir, PROMPTS[1:], 16)


def test_mixed_step_matches_hf(gpt_oss_dir, eager_pipeline, hf_logits):
    """One step holding a fresh prompt, the last 20 rows of a prompt whose first 25 are cached, and
    a decode row: each row's logits equal transformers' over the whole sequence."""
    pipe = eager_pipeline(gpt_oss_dir)
    long, fresh, short = PROMPTS[2], PROMPTS[1], PROMPTS[0]
    pipe.reset()
    first = AttentionMetadata.build([25, 4], [25, 4], [pipe.table(0), pipe.table(1)], pipe.block_size)
    pipe.forward(torch.tensor(long[:25] + short[:4]), torch.cat([torch.arange(25), torch.arange(4)]), first)
    lens = [len(fresh), 20, 1]
    meta = AttentionMetadata.build(lens, [len(fresh), 45, 5], [pipe.table(2), pipe.table(0), pipe.table(1)],
                                   pipe.block_size)
    ids = torch.tensor(fresh + long[25:] + short[4:])
    positions = torch.cat([torch.arange(len(fresh)), torch.arange(25, 45), torch.tensor([4])])
    rows = pipe.stages[-1].compute_logits(pipe.forward(ids, positions, meta)).split(lens)
    torch.testing.assert_close(rows[0], hf_logits(gpt_oss_dir, fresh), atol=1e-4, rtol=0)
    torch.testing.assert_close(rows[1], hf_logits(gpt_oss_dir, long)[25:], atol=1e-4, rtol=0)
    torch.testing.assert_close(rows[2], hf_logits(gpt_oss_dir, short)[4:], atol=1e-4, rtol=0)


def test_the_sinks_and_the_window_change_the_logits(gpt_oss_dir, eager_pipeline, hf_logits):
    """Guards the oracle: without sinks, or with every layer full, the logits leave transformers'."""
    want = hf_logits(gpt_oss_dir, PROMPTS[2])
    pipe = eager_pipeline(gpt_oss_dir)
    attns = [layer.self_attn for layer in pipe.stages[0].layers]
    assert [a.window for a in attns] == [8, None, 8]
    sinks = [a.sinks.detach().clone() for a in attns]
    for a in attns:
        a.sinks.data.fill_(float("-inf"))
    assert (pipe.prefill_logits(PROMPTS[2]) - want).abs().max() > 1e-2
    for a, s in zip(attns, sinks):
        a.sinks.data.copy_(s)
        a.window = None
    assert (pipe.prefill_logits(PROMPTS[2])[8:] - want[8:]).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
])
def test_yarn_tables_equal_transformers(rope):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = tf.Qwen3Config(hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=131072,
                            rope_parameters=dict(rope))
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    params = rope_parameters(config)
    assert torch.equal(rope_inv_freq(64, params), want_inv)
    assert rope_attention_scaling(params) == pytest.approx(want_scale, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("pp_size", [1, 2])
def test_engine_greedy_matches_hf(gpt_oss_dir, hf_greedy, pp_size):
    """Through the engine: batched prompts in chunks of 32 rows, then one that hits the prefix cache
    (the window layers' masks over cached blocks), decode rows of several sequences in one step."""
    from stagewise import LLM, SamplingParams
    shared = [(7 * i) % 800 + 5 for i in range(40)]
    prompts = [shared + [11, 12, 13], list(range(10, 31)), [5], shared + [99]]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(model=str(gpt_oss_dir), pp_size=pp_size, chunked_prefill_size=32, enable_prefix_caching=True,
             dtype="float32", prefill_graph="off") as llm:
        first = llm.generate(prompt_token_ids=prompts[:3], sampling_params=greedy, use_tqdm=False)
        second = llm.generate(prompt_token_ids=prompts[3:], sampling_params=greedy, use_tqdm=False)
    assert second[0].num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in first + second] == hf_greedy(gpt_oss_dir, prompts, 10)
