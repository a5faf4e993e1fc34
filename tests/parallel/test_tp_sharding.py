"""Tensor-parallel sharding (parallel/tp.py) in one process: each rank's slices of the tiny
checkpoints, run as threads joined by the shared-memory collectives, give the logits and greedy
tokens of the unsharded model (uneven head splits too); the heads and slices each rank holds; and
the sizes refused."""
from __future__ import annotations

import pytest
import torch

from stagewise.parallel import tp

PROMPT = [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47]


@pytest.mark.parametrize("family,size", [("llama", 2), ("llama", 4), ("llama_tied", 2), ("qwen2", 2),
                                         ("qwen3", 2), ("mistral", 2), ("gpt2", 2), ("gpt2", 4),
                                         ("qwen2_tied", 2), ("llama_uneven", 2), ("llama_uneven_mqa", 2),
                                         ("gpt2_3h", 2)])
def test_ranks_together_give_the_unsharded_logits(request, eager_pipeline, tp_threads, family, size):
    """Uneven too: 9 q heads in 3 KV groups over 2 ranks (3 + 6 q heads), 3 q heads sharing 1 KV head
    (1 + 2), GPT-2's 3 heads (1 + 2)."""
    model_dir = request.getfixturevalue(f"{family}_dir")
    whole = eager_pipeline(model_dir)
    expected = whole.prefill_logits(PROMPT)
    pipes = tp_threads.sharded(model_dir, size)
    logits = tp_threads.on_ranks(size, lambda r: pipes[r].prefill_logits(PROMPT))
    for got in logits:          # the gathered layers: every output one chain over the whole input, as in one process
        assert torch.equal(got, expected), (got - expected).abs().max()
    tokens = tp_threads.on_ranks(size, lambda r: pipes[r].greedy(PROMPT, 12))
    assert tokens == [whole.greedy(PROMPT, 12)] * size


@pytest.mark.parametrize("family", ["llama", "llama_uneven"])
def test_pipeline_stages_shard_too(eager_pipeline, tp_threads, request, family):
    """TP x PP in one process: two stages, each split over two ranks (llama_uneven: unevenly, the
    tied head on the last)."""
    model_dir = request.getfixturevalue(f"{family}_dir")
    pipes = tp_threads.sharded(model_dir, 2, pp_size=2)
    tokens = tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPT, 12))
    assert tokens == [eager_pipeline(model_dir).greedy(PROMPT, 12)] * 2


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantization_at_load_shards_as_one_process_quantizes(eager_pipeline, tp_threads, llama_dir, kind):
    """`--quantization` with two ranks: each rank's o_proj and down_proj columns (32 of 64, 64 of 128)
    are whole 32-blocks of the full rows, so the ranks hold the one-process blocks: the same logits
    and tokens."""
    from stagewise.model.quantized import QuantLinear
    whole = eager_pipeline(llama_dir, quantization=kind)
    pipes = tp_threads.sharded(llama_dir, 2, quantization=kind)
    layers = [p.stages[0].layers[0] for p in pipes]
    assert all(isinstance(m, QuantLinear) for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj))
    for got in tp_threads.on_ranks(2, lambda r: pipes[r].prefill_logits(PROMPT)):
        assert torch.equal(got, whole.prefill_logits(PROMPT))
    assert tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPT, 12)) == [whole.greedy(PROMPT, 12)] * 2


SHAPES = [(9, 3), (12, 4), (8, 8), (3, 3), (32, 8), (3, 1), (9, 1), (8, 2), (14, 2), (6, 3)]   # (q heads, KV heads)


def test_head_ranges_cover_every_head_once_in_whole_groups():
    for (heads, kv), size in ((shape, size) for shape in SHAPES for size in (2, 3, 4, 6, 8)):
        try:
            tp.check_sizes("LlamaForCausalLM", "LlamaForCausalLM", heads, kv, 1680, 1680, size)
        except ValueError:
            assert heads < size or (kv < size and size % kv)
            continue
        _check_ranges(heads, kv, size)


def _check_ranges(heads: int, kv: int, size: int) -> None:
    group = heads // kv
    ranges = [tp.head_ranges(heads, kv, r, size) for r in range(size)]
    assert sorted(h for (q0, qn), _ in ranges for h in range(q0, q0 + qn)) == list(range(heads))
    for (q0, qn), (k0, kn) in ranges:       # each q head's KV head is on its rank: q heads per KV head kept
        assert qn >= 1 and all(k0 <= h // group < k0 + kn for h in range(q0, q0 + qn))
    holders = [[r for r, (_, (k0, kn)) in enumerate(ranges) if k0 <= h < k0 + kn] for h in range(kv)]
    assert [len(ranks) for ranks in holders] == [max(1, size // kv)] * kv      # split, or on size / kv ranks each
    if kv >= size:                     # whole groups, as even as KV heads allow
        kvs = [kn for _, (_, kn) in ranges]
        assert max(kvs) - min(kvs) <= 1 and all(qn == kn * group for (_, qn), (_, kn) in ranges)
    else:                              # a replicated KV head's q heads as even as they go
        for ranks in holders:
            counts = [ranges[r][0][1] for r in ranks]
            assert max(counts) - min(counts) <= 1 and sum(counts) == group


def test_the_default_models_heads_over_two_ranks():
    """SmolLM2-135M: 9 q heads in 3 KV groups of 3: 1 KV head (3 q) and 2 (6 q); its o_proj columns follow."""
    assert [tp.head_ranges(9, 3, r, 2) for r in range(2)] == [((0, 3), (0, 1)), ((3, 6), (1, 2))]
    assert tp.heaviest_rank(9, 3, 2) == 1
    assert [tp.head_ranges(3, 1, r, 2) for r in range(2)] == [((0, 1), (0, 1)), ((1, 2), (0, 1))]


def test_each_rank_holds_its_heads_and_vocabulary(llama_dir, llama_tied_dir, llama_uneven_dir, monkeypatch):
    """GQA with 4 q and 2 KV heads of 16: over 4 ranks each holds one q head and (replicated) the KV
    head its q head attends; the embedding and head hold a quarter of the vocabulary each. 9 q heads
    in 3 KV groups over 2 ranks: whole groups (3 + 6 q heads). The gathered layers (o_proj,
    down_proj) hold their share of the output rows, in blocks of 16, bias alike."""
    from safetensors.torch import load_file

    from stagewise.model.loader import load_model
    from stagewise.parallel.partition import StageInfo
    monkeypatch.setenv("STAGEWISE_PACKED_WEIGHTS", "0")        # compare the checkpoint layout
    ckpt = load_file(llama_dir / "model.safetensors")
    for rank in range(4):
        model = load_model(llama_dir, StageInfo.single(4), torch.float32, tp=(rank, 4))
        assert model.kv_cache_spec() == (1, 16)
        attn, kv = model.layers[0].self_attn, rank // 2
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)

        def part(name, lo, n, dim=0):
            return ckpt[f"model.layers.0.self_attn.{name}.weight"].narrow(dim, lo, n)
        expected = torch.cat([part("q_proj", 16 * rank, 16), part("k_proj", 16 * kv, 16), part("v_proj", 16 * kv, 16)])
        assert torch.equal(attn.qkv_proj.weight, expected)
        assert torch.equal(attn.o_proj.weight, part("o_proj", 16 * rank, 16))
        for ours, name in ((model.embed_tokens, "model.embed_tokens.weight"), (model.lm_head, "lm_head.weight")):
            assert torch.equal(ours.weight, ckpt[name][250 * rank:250 * (rank + 1)])
    ckpt = load_file(llama_uneven_dir / "model.safetensors")      # 9 q heads in 3 KV groups over 2 ranks
    for rank, (q0, qn, k0, kn) in enumerate([(0, 3, 0, 1), (3, 6, 1, 2)]):
        model = load_model(llama_uneven_dir, StageInfo.single(2), torch.float32, tp=(rank, 2))
        attn = model.layers[1].self_attn
        assert model.kv_cache_spec() == (kn, 16) and (attn.num_heads, attn.num_kv_heads) == (qn, kn)
        expected = torch.cat([part("q_proj", 16 * q0, 16 * qn), part("k_proj", 16 * k0, 16 * kn),
                              part("v_proj", 16 * k0, 16 * kn)])
        assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, expected)
        assert torch.equal(model.layers[0].self_attn.o_proj.weight, part("o_proj", 64 * rank, 64 + 16 * rank))
    ckpt = load_file(llama_tied_dir / "model.safetensors")
    for rank in range(2):
        layer = load_model(llama_tied_dir, StageInfo.single(3), torch.float32, tp=(rank, 2)).layers[0]
        for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
            assert torch.equal(layer.get_parameter(name), ckpt[f"model.layers.0.{name}"][32 * rank:32 * (rank + 1)])


def test_shared_memory_and_gloo_groups_agree(tmp_path, tp_threads):
    """The engine's two groups (parallel/groups.py) on the same inputs: the same sums and gathers."""
    from stagewise.parallel.groups import GlooGroup
    xs = [torch.randn(300, 129, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    shm = tp_threads.groups(2)
    gloo = tp_threads.on_ranks(2, lambda r: GlooGroup(str(tmp_path / "store"), r, 2, timeout_s=30.0))
    for pair in (shm, gloo):
        sums = tp_threads.on_ranks(2, lambda r, pair=pair: pair[r].all_reduce(xs[r]))
        gathered = tp_threads.on_ranks(2, lambda r, pair=pair: pair[r].all_gather(xs[r]))
        assert all(torch.equal(s, xs[0] + xs[1]) for s in sums)
        assert all(torch.equal(g, torch.cat(xs, 1)) for g in gathered)


@pytest.mark.parametrize("heads,kv,vocab,inter,size,problem", [
    (4, 2, 1002, 129, 3, "is not a multiple of the model's 2 KV heads"),
    (4, 2, 1001, 128, 2, "1001 vocabulary entries"),
    (4, 2, 1000, 130, 4, "130 MLP columns"), (12, 3, 1000, 128, 4, "3 KV heads"),
    (4, 4, 1000, 128, 8, "more than the model's 4 attention heads")])
def test_bad_sizes_are_one_sentence(heads, kv, vocab, inter, size, problem):
    with pytest.raises(ValueError, match=problem):
        tp.check_sizes("LlamaForCausalLM", "LlamaForCausalLM", heads, kv, vocab, inter, size)
    with pytest.raises(ValueError, match="runs with tp_size 1"):
        tp.check_sizes(None, "PhiForCausalLM", 4, 4, 1000, 128, 2)
    tp.check_sizes("LlamaForCausalLM", "LlamaForCausalLM", 4, 2, 1000, 128, 1)
    tp.check_sizes("LlamaForCausalLM", "LlamaForCausalLM", 9, 3, 49152, 1536, 2)     # uneven heads: split by groups
