"""The tape emulator catches what only a real CUDA graph would otherwise reveal: frozen Python,
host syncs and per-step tensors read inside a captured segment."""
import pytest
import torch
from graph_toys import Step, ToyStage, clone_batch, fill_history, kv_caches
from tape import CaptureError, TapeBackend

from stagewise.graph.policy import GraphVerdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.model.attention import ForwardBatch
from stagewise.parallel.partition import stage_infos


def runner_for(model_cls, emulation, backend="breakable"):
    info = stage_infos(2, 1)[0]
    model, batch = model_cls(info).eval(), ForwardBatch(None, kv_caches(info))
    policy = resolve_graph_policy(backend, buckets=[8], device_type="cpu")
    emulator = TapeBackend if emulation == "tape" else None
    runner = StageGraphRunner(model, info, policy, batch, torch.float32, "cpu", emulator=emulator, max_seq_len=32)
    return runner, model, batch


class BranchOnBatch(ToyStage):
    """Python that reads the batch inside the body: fine eager, frozen (wrong) in a graph."""

    def forward(self, input_ids, positions, batch, **kw):
        out = super().forward(input_ids, positions, batch, **kw)
        return out * 2 if batch.meta.num_tokens > 4 else out


class ItemInBody(ToyStage):
    def forward(self, input_ids, positions, batch, **kw):
        out = super().forward(input_ids, positions, batch, **kw)
        return out / out.abs().max().item()


class TolistInBody(ToyStage):
    def forward(self, input_ids, positions, batch, **kw):
        positions.tolist()
        return super().forward(input_ids, positions, batch, **kw)


class PerStepTensor(ToyStage):
    def forward(self, input_ids, positions, batch, **kw):
        out = super().forward(input_ids, positions, batch, **kw)
        return out + batch.meta.slot_mapping[:1].float()   # a per-step tensor, not a static buffer


class PythonDataTensor(ToyStage):
    def forward(self, input_ids, positions, batch, **kw):
        return super().forward(input_ids, positions, batch, **kw) * torch.tensor([1.0])


class MaskIndexing(ToyStage):
    def forward(self, input_ids, positions, batch, **kw):
        out = super().forward(input_ids, positions, batch, **kw)
        return out[out.abs() >= 0].reshape(out.shape)


def run_step(runner, model, batch, seqs):
    step = Step(seqs)
    fill_history([batch])
    ref = clone_batch(batch)
    ref.meta = step.meta
    with torch.no_grad():
        want = model(step.input_ids, step.positions, ref)
    got = runner.forward(GraphVerdict("prefill", 8), step.input_ids, step.positions, step.meta)
    return got, want


def test_tape_exposes_frozen_branch_that_rerun_hides():
    # capture runs with the dummy batch (8 rows), so the branch freezes to "x2"; a 3-token step differs
    rerun, model, batch = runner_for(BranchOnBatch, "rerun")
    rerun.capture()
    got, want = run_step(rerun, model, batch, [(3, 0)])
    torch.testing.assert_close(got, want)
    tape, model, batch = runner_for(BranchOnBatch, "tape")
    tape.capture()
    got, want = run_step(tape, model, batch, [(3, 0)])
    torch.testing.assert_close(got, want * 2)


@pytest.mark.parametrize("model_cls,words", [
    (ItemInBody, "item"),
    (TolistInBody, "tolist"),
    (PerStepTensor, "registered persistent"),
    (PythonDataTensor, "Python data"),
    (MaskIndexing, "boolean mask"),
])
@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_tape_refuses_uncapturable_body(model_cls, words, backend):
    runner, _, _ = runner_for(model_cls, "tape", backend)
    with pytest.raises(CaptureError, match=words):
        runner.capture()
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist or callable(torch.Tensor.tolist)
    torch.zeros(2).tolist()   # host reads are allowed again after a failed capture


def test_tape_breakable_has_one_break_per_attention_layer():
    runner, model, _ = runner_for(ToyStage, "tape")
    runner.capture()
    graph = runner._kinds["prefill"].backend._graphs[(8, "ids")]
    assert len(graph.breaks) == len(model.layers) and len(graph.segments) == len(model.layers) + 1
    full, _, _ = runner_for(ToyStage, "tape", "full")
    full.capture()
    graph = full._kinds["prefill"].backend._graphs[(8, "ids")]
    assert len(graph.breaks) == 0 and len(graph.segments) == 1


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_tape_replay_follows_new_input_data(mode):
    from tape import Provenance, TapeSegment
    x = torch.randn(4, 3)
    seg = TapeSegment(Provenance([x]))
    with mode():
        seg.begin()
        try:
            y = x.t().reshape(-1) * 2           # reshape of a transpose copies: must be re-run
            z = x.view(-1)[:5] + 1              # views: skipped, still alias x
            w = torch.empty(3)
            torch.add(x[0], 1.0, out=w)         # out= : re-run
        finally:
            seg.end()
        x.copy_(torch.randn(4, 3))
        seg.replay()
        torch.testing.assert_close(y, x.t().reshape(-1) * 2)
        torch.testing.assert_close(z, x.view(-1)[:5] + 1)
        torch.testing.assert_close(w, x[0] + 1)
