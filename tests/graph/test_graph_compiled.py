"""The `compiled` backend: per-bucket torch.compile fed from the static buffers (the suite's one
compile test: compiling costs seconds per shape on CPU)."""
import pytest
import torch
from graph_toys import Step, clone_batch, fill_history, toy_pipeline

from stagewise.graph.policy import GraphVerdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.parallel.proxy import ProxyTensors


@pytest.mark.slow
def test_compiled_replay_equals_eager_without_recompiling():
    import torch._dynamo.utils as dynamo_utils
    model, batch = toy_pipeline(2, 2)[1]
    policy = resolve_graph_policy("compiled", buckets=[8], device_type="cpu")
    runner = StageGraphRunner(model, model.stage, policy, batch, torch.float32, "cpu")
    runner.capture()
    frames_after_capture = dict(dynamo_utils.counters["stats"]).get("unique_graphs", 0)
    gen = torch.Generator().manual_seed(0)
    for seqs in ([(7, 0)], [(3, 2), (1, 5), (1, 1)]):
        step = Step(seqs)
        fill_history([batch])
        ref = clone_batch(batch)
        ref.meta = step.meta
        proxy = ProxyTensors({k: torch.randn(step.num_tokens, model.hidden_size, generator=gen)
                              for k in model.proxy_keys})
        with torch.no_grad():
            want = model(None, step.positions, ref, pp_proxy_tensors=proxy)
        got = runner.forward(GraphVerdict("prefill", 8), None, step.positions, step.meta, proxy=proxy)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for c, r in zip(batch.kv_caches, ref.kv_caches):
            if c is not None:
                torch.testing.assert_close(c[:, 1:], r[:, 1:])
    # a different live batch must not recompile: the metadata stays behind the graph break
    assert dict(dynamo_utils.counters["stats"]).get("unique_graphs", 0) == frames_after_capture
    assert runner.stats()["replays"] == {8: 2} and runner.stats()["backend"] == "compiled"
