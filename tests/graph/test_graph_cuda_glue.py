"""The CUDA backends' Python glue, run on CPU with CUDAGraph replaced by a tape segment and
synchronize by a no-op: catches mistakes in cuda.py that would otherwise first show on a GPU."""
import contextlib
import types

import pytest
import torch
from graph_toys import Step, clone_batch, fill_history, toy_pipeline
from tape import TapeSegment

from stagewise.graph import cuda
from stagewise.graph.policy import GraphVerdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.parallel.proxy import ProxyTensors


class FakeCUDAGraph:
    def __init__(self):
        self.segment = TapeSegment(None)

    def capture_begin(self, pool=None):
        self.segment.begin()

    def capture_end(self):
        self.segment.end()

    def replay(self):
        self.segment.replay()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return types.SimpleNamespace(pool=None, scope=contextlib.nullcontext, memory=lambda: (0, 0))


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_cuda_backend_glue_replays_like_eager(fake_cuda, backend):
    model, batch = toy_pipeline(6, 3)[1]
    policy = resolve_graph_policy(backend, buckets=[4, 8], device_type="cpu", full_slots=4)
    runner = StageGraphRunner(model, model.stage, policy, batch, torch.float32, "cpu", max_seq_len=32)
    cls = cuda.CudaBreakableBackend if backend == "breakable" else cuda.CudaFullBackend
    runner._kinds["prefill"].backend = cls(fake_cuda, policy.max_rows)
    runner.capture()
    graph = runner._kinds["prefill"].backend._graphs[(8, "proxy")]
    assert len(graph.segments) == (len(model.layers) + 1 if backend == "breakable" else 1)
    for seqs in ([(7, 0)], [(3, 2), (1, 5), (1, 1)]):
        step = Step(seqs)
        fill_history([batch])
        ref = clone_batch(batch)
        ref.meta = step.meta
        gen = torch.Generator().manual_seed(4)
        proxy = ProxyTensors({k: torch.randn(step.num_tokens, model.hidden_size, generator=gen)
                              for k in model.proxy_keys})
        with torch.inference_mode():
            want = model(None, step.positions, ref, pp_proxy_tensors=proxy)
        got = runner.forward(GraphVerdict("prefill", 8), None, step.positions, step.meta, proxy=proxy)
        for k in want.keys():
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
        # outputs live in the backend's persistent output buffers, not in per-capture memory
        out_ptrs = {t.untyped_storage().data_ptr() for t in runner._kinds["prefill"].backend.outputs.tensors()}
        assert {got[k].untyped_storage().data_ptr() for k in got.keys()} <= out_ptrs
