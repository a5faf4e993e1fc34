"""Tensor-parallel sharding (parallel/tp.py) in one process: each rank's slices of the tiny
checkpoints, run as threads joined by the shared-memory collectives, give the logits and greedy
tokens of the unsharded model; the slices each rank holds; and the sizes refused."""
from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch

from stagewise.kernels import comm
from stagewise.parallel import tp

PROMPT = [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47]


def groups(size: int) -> list[comm.ShmGroup]:
    path = os.path.join(comm.shm_dir(), f"stagewise-test-{uuid.uuid4().hex}")
    comm.create(path, size, 1 << 20)
    try:
        return [comm.ShmGroup(path, r, size, timeout_s=30.0) for r in range(size)]
    finally:
        os.unlink(path)


def on_ranks(size: int, fn) -> list:
    """fn(rank) on `size` threads at once (the ranks); their results in rank order."""
    out: list = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            with torch.inference_mode():
                out[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def sharded(eager_pipeline, model_dir, size: int, pp_size: int = 1):
    pipes = [eager_pipeline(model_dir, pp_size=pp_size, tp=(r, size)) for r in range(size)]
    for stage in range(pp_size):
        for pipe, group in zip(pipes, groups(size)):
            tp.connect(pipe.stages[stage], group, logits_to=-1)
    return pipes


@pytest.mark.parametrize("family,size", [("llama", 2), ("llama", 4), ("llama_tied", 2), ("qwen2", 2),
                                         ("qwen3", 2), ("mistral", 2), ("gpt2", 2), ("gpt2", 4)])
def test_ranks_together_give_the_unsharded_logits(request, eager_pipeline, family, size):
    model_dir = request.getfixturevalue(f"{family}_dir")
    whole = eager_pipeline(model_dir)
    expected = whole.prefill_logits(PROMPT)
    pipes = sharded(eager_pipeline, model_dir, size)
    logits = on_ranks(size, lambda r: pipes[r].prefill_logits(PROMPT))
    for got in logits:
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    tokens = on_ranks(size, lambda r: pipes[r].greedy(PROMPT, 12))
    assert tokens == [whole.greedy(PROMPT, 12)] * size


def test_pipeline_stages_shard_too(eager_pipeline, llama_dir):
    """TP x PP in one process: two stages, each split over two ranks (the tied head on the last)."""
    pipes = sharded(eager_pipeline, llama_dir, 2, pp_size=2)
    tokens = on_ranks(2, lambda r: pipes[r].greedy(PROMPT, 12))
    assert tokens == [eager_pipeline(llama_dir).greedy(PROMPT, 12)] * 2


def test_each_rank_holds_its_heads_and_vocabulary(llama_dir, llama_tied_dir, monkeypatch):
    """GQA with 4 q and 2 KV heads of 16: over 4 ranks each holds one q head and (replicated) the KV
    head its q head attends; the embedding and head hold a quarter of the vocabulary each; a
    row-parallel bias counts once (rank 0 holds it)."""
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
        assert torch.equal(attn.o_proj.weight, part("o_proj", 16 * rank, 16, dim=1))
        for ours, name in ((model.embed_tokens, "model.embed_tokens.weight"), (model.lm_head, "lm_head.weight")):
            assert torch.equal(ours.weight, ckpt[name][250 * rank:250 * (rank + 1)])
    ckpt = load_file(llama_tied_dir / "model.safetensors")
    for rank in range(2):
        layer = load_model(llama_tied_dir, StageInfo.single(3), torch.float32, tp=(rank, 2)).layers[0]
        for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
            full = ckpt[f"model.layers.0.{name}"]
            assert torch.equal(layer.get_parameter(name), full if rank == 0 else torch.zeros_like(full))


def test_shared_memory_and_gloo_groups_agree(tmp_path):
    """The engine's two groups (parallel/groups.py) on the same inputs: the same sums and gathers."""
    from stagewise.parallel.groups import GlooGroup
    xs = [torch.randn(300, 129, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    shm = groups(2)
    gloo = on_ranks(2, lambda r: GlooGroup(str(tmp_path / "store"), r, 2, timeout_s=30.0))
    for pair in (shm, gloo):
        sums = on_ranks(2, lambda r, pair=pair: pair[r].all_reduce(xs[r]))
        gathered = on_ranks(2, lambda r, pair=pair: pair[r].all_gather(xs[r]))
        assert all(torch.equal(s, xs[0] + xs[1]) for s in sums)
        assert all(torch.equal(g, torch.cat(xs, 1)) for g in gathered)


@pytest.mark.parametrize("heads,kv,vocab,inter,size,problem", [
    (4, 2, 1000, 128, 3, "4 attention heads"), (4, 2, 1001, 128, 2, "1001 vocabulary entries"),
    (4, 2, 1000, 130, 4, "130 MLP columns"), (12, 3, 1000, 128, 4, "3 KV heads")])
def test_bad_sizes_are_one_sentence(heads, kv, vocab, inter, size, problem):
    with pytest.raises(ValueError, match=problem):
        tp.check_sizes("LlamaForCausalLM", "LlamaForCausalLM", heads, kv, vocab, inter, size)
    with pytest.raises(ValueError, match="runs with tp_size 1"):
        tp.check_sizes(None, "PhiForCausalLM", 4, 4, 1000, 128, 2)
    tp.check_sizes("LlamaForCausalLM", "LlamaForCausalLM", 4, 2, 1000, 128, 1)
