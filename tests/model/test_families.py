"""Every family against HF transformers (fp32): prompt logits, greedy tokens, stage splits,
input embeddings and mixed prefill batches, through the paged KV cache."""
from __future__ import annotations

import pytest
import torch

from stagewise.model.attention import AttentionMetadata

PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9))]  # 5, 17 and 45 tokens


def test_prefill_logits_match_hf(family_dir, eager_pipeline, hf_logits):
    pipe = eager_pipeline(family_dir)
    for ids in PROMPTS:
        ours = pipe.prefill_logits(ids)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, hf_logits(family_dir, ids), atol=1e-4, rtol=0)


def test_greedy_matches_hf_generate(family_dir, eager_pipeline, hf_greedy):
    pipe = eager_pipeline(family_dir)
    expected = hf_greedy(family_dir, PROMPTS, 32)
    assert [pipe.greedy(ids, 32) for ids in PROMPTS] == expected


@pytest.mark.parametrize("pp_size", [2, 3])
def test_stage_split_gives_same_logits(family_dir, eager_pipeline, pp_size):
    from stagewise.checkpoint.facts import read_facts
    if pp_size > read_facts(family_dir).num_layers:
        pytest.skip("fewer layers than stages")
    whole = eager_pipeline(family_dir).prefill_logits(PROMPTS[1])
    split = eager_pipeline(family_dir, pp_size=pp_size)
    assert [m.stage.size for m in split.stages] == [pp_size] * pp_size
    torch.testing.assert_close(split.prefill_logits(PROMPTS[1]), whole, atol=1e-5, rtol=0)


def test_split_greedy_matches_single_stage(llama_dir, eager_pipeline):
    ids = PROMPTS[2]
    assert eager_pipeline(llama_dir, pp_size=2).greedy(ids, 16) == eager_pipeline(llama_dir).greedy(ids, 16)


def test_input_embeds_equal_token_ids(family_dir, eager_pipeline, hf_logits):
    pipe = eager_pipeline(family_dir, pp_size=2)
    ids = PROMPTS[1]
    embeds = pipe.stages[0].embed_tokens(torch.tensor(ids))  # [T, H]
    assert embeds.shape == (len(ids), pipe.stages[0].hidden_size)
    by_embeds = pipe.prefill_logits(ids, input_embeds=embeds)
    torch.testing.assert_close(by_embeds, pipe.prefill_logits(ids), atol=1e-6, rtol=0)
    # HF with inputs_embeds (for GPT-2: token embeddings, positions added inside) agrees too.
    torch.testing.assert_close(by_embeds, hf_logits(family_dir, ids, inputs_embeds=embeds), atol=1e-4, rtol=0)


def test_mixed_prefill_batch_matches_single_prompts(family_dir, eager_pipeline, hf_logits):
    pipe = eager_pipeline(family_dir)
    lens = [len(p) for p in PROMPTS]
    meta = AttentionMetadata.build(lens, lens, [pipe.table(i) for i in range(3)], pipe.block_size)
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    pipe.reset()
    logits = pipe.stages[-1].compute_logits(pipe.forward(ids, positions, meta))
    for ids_one, rows in zip(PROMPTS, logits.split(lens)):
        torch.testing.assert_close(rows, hf_logits(family_dir, ids_one), atol=1e-4, rtol=0)


def test_first_stage_proxy_carries_contract_keys(family_dir, eager_pipeline):
    pipe = eager_pipeline(family_dir, pp_size=2)
    first = pipe.stages[0]
    meta = AttentionMetadata.build([5], [5], [pipe.table(0)], pipe.block_size)
    pipe.batches[0].meta = meta
    proxy = first(torch.tensor(PROMPTS[0]), torch.arange(5), pipe.batches[0])
    assert tuple(proxy.keys()) == first.proxy_keys
    assert proxy.num_rows == 5 and proxy["hidden_states"].shape == (5, first.hidden_size)


def test_llama_first_stage_with_no_layers_still_sends_residual(llama_dir, eager_pipeline):
    """An explicit partition cannot give a stage 0 layers, so build such a stage directly."""
    from stagewise.model.loader import load_model
    from stagewise.parallel.partition import StageInfo
    stage = StageInfo(rank=0, size=2, start=0, end=0, num_layers=4)
    model = load_model(llama_dir, stage, torch.float32)
    proxy = model(torch.tensor([3, 4]), torch.arange(2), None)
    assert set(proxy.keys()) == {"hidden_states", "residual"}
    assert torch.equal(proxy["residual"], torch.zeros(2, 64))
    assert torch.equal(proxy["hidden_states"], model.embed_tokens(torch.tensor([3, 4])))


def test_bfloat16_stage_runs_close_to_float32(family_dir, eager_pipeline):
    ids = PROMPTS[1]
    full = eager_pipeline(family_dir).prefill_logits(ids)
    half = eager_pipeline(family_dir, pp_size=2, dtype=torch.bfloat16).prefill_logits(ids)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert (half - full).abs().max() < 0.1 * full.abs().max()
