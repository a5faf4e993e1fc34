"""Real CUDA graph backends (cuda_breakable, cuda_full): replay equals eager. Skipped without CUDA."""
import pytest
import torch
from graph_toys import Step, clone_batch, fill_history, toy_pipeline

from stagewise.graph.policy import GraphVerdict, decide_verdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.parallel.proxy import ProxyTensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"
CASES = [[(1, 5)], [(7, 0)], [(8, 0)], [(5, 3), (1, 9), (1, 2)], [(3, 0), (1, 4), (4, 2)]]


def make_runner(model, batch, backend, decode=False):
    policy = resolve_graph_policy(backend, buckets=[4, 8, 16], decode_graph=decode, decode_graph_max_bs=8,
                                  device_type="cuda", full_slots=4)
    runner = StageGraphRunner(model, model.stage, policy, batch, torch.float32, DEV, max_seq_len=32)
    runner.capture()
    return runner


def proxy_for(model, T, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return ProxyTensors({k: torch.randn(T, model.hidden_size, generator=gen).to(DEV) for k in model.proxy_keys})


def eager(model, batch, step, proxy=None):
    batch.meta = step.meta
    with torch.inference_mode():
        return model(step.input_ids if model.stage.is_first else None, step.positions, batch, pp_proxy_tensors=proxy)


def check(got, want):
    if isinstance(want, ProxyTensors):
        for k in want.keys():
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["breakable", "full"])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_cuda_replay_equals_eager(backend, position):
    model, batch = toy_pipeline(6, 3, device=DEV)[position]
    runner = make_runner(model, batch, backend)
    assert runner.graph_pool_bytes() > 0
    for seqs in CASES:
        step = Step(seqs, device=DEV)
        fill_history([batch])
        ref = clone_batch(batch)
        proxy = None if model.stage.is_first else proxy_for(model, step.num_tokens)
        want = eager(model, ref, step, proxy)
        got = runner.forward(GraphVerdict("prefill", 8), step.input_ids if position == 0 else None,
                             step.positions, step.meta, proxy=proxy)
        check(got, want)
        for c, r in zip(batch.kv_caches, ref.kv_caches):
            if c is not None:
                torch.testing.assert_close(c[:, 1:], r[:, 1:])


def test_cuda_breakable_segments_per_layer_and_decode_full():
    model, batch = toy_pipeline(6, 3, device=DEV)[1]
    runner = make_runner(model, batch, "breakable", decode=True)
    graph = runner._kinds["prefill"].backend._graphs[(8, "proxy")]
    assert len(graph.segments) == len(model.layers) + 1
    for seqs in ([(1, 4)], [(1, 3), (1, 9), (1, 1)]):
        step = Step(seqs, device=DEV)
        verdict = decide_verdict(runner.policy, step.num_tokens, True, len(seqs))
        assert verdict.kind == "decode"
        fill_history([batch])
        ref = clone_batch(batch)
        proxy = proxy_for(model, step.num_tokens)
        check(runner.forward(verdict, None, step.positions, step.meta, proxy=proxy), eager(model, ref, step, proxy))


def test_cuda_pp2_checkpoint_greedy_matches_hf(llama_dir, hf_greedy):
    from stagewise.checkpoint.facts import read_facts
    from stagewise.model.attention import AttentionMetadata, ForwardBatch
    from stagewise.model.loader import load_model
    from stagewise.parallel.partition import stage_infos
    n_layers = read_facts(llama_dir).num_layers
    policy = resolve_graph_policy("breakable", chunked_prefill_size=64, pp_size=2, device_type="cuda",
                                  decode_graph=True, decode_graph_max_bs=4)
    stages = []
    for info in stage_infos(n_layers, 2):
        model = load_model(llama_dir, info, torch.float32, DEV)
        hkv, d = model.kv_cache_spec()
        caches = [torch.zeros(2, 8, 16, hkv, d, device=DEV) if info.owns(i) else None for i in range(n_layers)]
        runner = StageGraphRunner(model, info, policy, ForwardBatch(None, caches), torch.float32, DEV, max_seq_len=64)
        runner.capture()
        stages.append((model, runner))
    ids = torch.randint(3, 900, (47,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens, table = [], [1, 2, 3, 4]
    for i in range(5):
        if i == 0:
            meta = AttentionMetadata.build([47], [47], [table], 16, DEV)
            x, pos = torch.tensor(ids, device=DEV), torch.arange(47, device=DEV)
        else:
            meta = AttentionMetadata.build([1], [47 + i], [table], 16, DEV)
            x, pos = torch.tensor(tokens[-1:], device=DEV), torch.tensor([46 + i], device=DEV)
        verdict = decide_verdict(policy, meta.num_tokens, i > 0, 1)
        assert verdict.bucket == (48 if i == 0 else 1)
        out = None
        for model, runner in stages:
            with torch.inference_mode():
                out = runner.forward(verdict, x if model.stage.is_first else None, pos, meta, proxy=out)
                out = out.clone()
        tokens.append(int(stages[-1][0].compute_logits(out)[-1].argmax()))
    assert tokens == hf_greedy(llama_dir, [ids], 5)[0]
