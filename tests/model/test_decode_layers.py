"""`stagewise::decode_layers` (csrc/layers_ops.cpp): a Llama stage's eager CPU decode
step in one call gives the modules' bits (hidden states, residual stream, KV cache) over decode
batches of several sequences, quantized (float32: exact kernels; bfloat16: fast kernels) and float
weights in the packed kernels' layout, one stage and
two, biases (Qwen2's qkv, llama_tied's attention and MLP), mixed-type fused projections; a verify
step (several rows a sequence) gives the bits of decoding its rows one by one; stages it cannot run
fall back to the modules; bad lists are refused by both registrations."""

import numpy as np
import pytest
import torch

from stagewise.kernels import build, native
from stagewise.kernels import layers as cpu_layers
from stagewise.model import llama
from stagewise.model.attention import AttentionMetadata

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")

PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 2, 17], [8, 8, 31, 12, 19, 6, 27, 3, 11]]


def _decode_steps(pipe, steps: int = 3):
    """Prefill each prompt alone, then `steps` decode steps of all three sequences in one batch:
    the last stage's hidden states of every decode step, and every stage's KV caches at the end."""
    pipe.reset()
    last = []
    for seq, ids in enumerate(PROMPTS):
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [pipe.table(seq)], pipe.block_size)
        hidden = pipe.forward(torch.tensor(ids), torch.arange(len(ids)), meta)
        last.append(int(pipe.stages[-1].compute_logits(hidden)[-1].argmax()))
    outs = []
    for step in range(steps):
        lens = [len(ids) + step + 1 for ids in PROMPTS]
        meta = AttentionMetadata.build([1] * 3, lens, [pipe.table(s) for s in range(3)], pipe.block_size)
        hidden = pipe.forward(torch.tensor(last), torch.tensor([n - 1 for n in lens]), meta)
        outs.append(hidden.clone())
        last = pipe.stages[-1].compute_logits(hidden).argmax(-1).tolist()
    caches = [c.clone() for batch in pipe.batches for c in batch.kv_caches if c is not None]
    return outs, caches


def _one_call_count(monkeypatch) -> list[int]:
    """Counts the decode steps (per stage) that ran the op."""
    used: list[int] = []
    real = llama.LlamaForCausalLM._one_call

    def spy(self, *args):
        fn = real(self, *args)
        if fn is not None:
            used.append(1)
        return fn
    monkeypatch.setattr(llama.LlamaForCausalLM, "_one_call", spy)
    return used


def _same_both_ways(pipe, monkeypatch) -> int:
    used = _one_call_count(monkeypatch)
    with torch.no_grad():
        outs, caches = _decode_steps(pipe)
        ran = len(used)
        monkeypatch.setattr(llama, "ONE_CALL_DECODE", False)
        ref_outs, ref_caches = _decode_steps(pipe)
    assert len(used) == ran            # the modules' run never took the op
    for got, ref in zip(outs + caches, ref_outs + ref_caches):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    return ran


def _needs_op():
    if build.cxx_compiler() is None:
        pytest.skip("no C++ compiler")
    assert cpu_layers.available(), "the decode_layers op did not build"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int4", "int8", None])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_one_call_gives_the_modules_bits(llama_dir, eager_pipeline, monkeypatch, dtype, quantization, pp_size):
    _needs_op()
    pipe = eager_pipeline(llama_dir, pp_size=pp_size, dtype=dtype, quantization=quantization)
    assert _same_both_ways(pipe, monkeypatch) == 3 * pp_size      # every stage of every decode step


def test_mixed_type_projections(llama_dir, gguf_tools, eager_pipeline, tmp_path, monkeypatch):
    """A GGUF file whose fused projections mix types (v and down in Q4_0, the rest Q8_0, as Q4_K_M
    files keep v in Q6_K): the op's qlinear_cat parts."""
    import gguf
    from transformers import AutoConfig
    _needs_op()
    config = AutoConfig.from_pretrained(llama_dir)
    tensors = gguf_tools.gguf_tensors(llama_dir, config, "llama")
    for name, array in list(tensors.items()):
        if array.ndim == 2:
            qt = gguf.GGMLQuantizationType.Q4_0 if (".attn_v." in name or ".ffn_down." in name) \
                else gguf.GGMLQuantizationType.Q8_0
            tensors[name] = (gguf.quants.quantize(np.ascontiguousarray(array), qt), qt)
    path = gguf_tools.write_gguf(llama_dir, tmp_path / "mixed.gguf", tensors=tensors)
    pipe = eager_pipeline(path, dtype=torch.float32)
    qkv = pipe.stages[0].layers[0].self_attn.qkv_proj
    assert len(qkv.segments) == 2
    assert _same_both_ways(pipe, monkeypatch) == 3


@pytest.mark.parametrize("family", ["qwen2", "llama_tied"])
def test_biases(family, eager_pipeline, monkeypatch, request):
    _needs_op()
    pipe = eager_pipeline(request.getfixturevalue(f"{family}_dir"), quantization="int8")
    assert _same_both_ways(pipe, monkeypatch) == 3


def test_stages_it_cannot_run_use_the_modules(qwen3_dir, llama_dir, eager_pipeline, monkeypatch):
    """q/k norms (Qwen3), or float weights in the checkpoint's layout: the modules, every step."""
    _needs_op()
    monkeypatch.setenv("STAGEWISE_PACKED_WEIGHTS", "0")
    for pipe in (eager_pipeline(qwen3_dir, quantization="int8"), eager_pipeline(llama_dir)):
        assert _same_both_ways(pipe, monkeypatch) == 0
        assert pipe.stages[0]._plan_decode_layers() is None


DRAFTS = [[11, 4, 29, 7], [3, 3, 18, 40], [21, 9, 2, 13]]     # each sequence's next four tokens


def _continue(pipe, rows_per_step: int):
    """Prefill each prompt alone, then feed every sequence its DRAFTS in steps of `rows_per_step`
    rows per sequence (1: decode steps; 4: one verify step): the last stage's hidden states of the
    fed rows, `[sequence, row]`, and every stage's KV caches."""
    pipe.reset()
    for seq, ids in enumerate(PROMPTS):
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [pipe.table(seq)], pipe.block_size)
        pipe.forward(torch.tensor(ids), torch.arange(len(ids)), meta)
    rows: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    for first in range(0, 4, rows_per_step):
        lens = [len(ids) + first + rows_per_step for ids in PROMPTS]
        meta = AttentionMetadata.build([rows_per_step] * 3, lens, [pipe.table(s) for s in range(3)], pipe.block_size)
        ids = torch.tensor([d[first:first + rows_per_step] for d in DRAFTS]).flatten()
        positions = torch.tensor([list(range(n - rows_per_step, n)) for n in lens]).flatten()
        hidden = pipe.forward(ids, positions, meta).view(3, rows_per_step, -1)
        for seq in range(3):
            rows[seq] += list(hidden[seq].clone())
    caches = [c.clone() for batch in pipe.batches for c in batch.kv_caches if c is not None]
    return rows, caches


@pytest.mark.parametrize("dtype,quantization", [(torch.float32, "int4"), (torch.bfloat16, "int8"),
                                                (torch.float32, None)])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_verify_steps_give_decode_bits(llama_dir, eager_pipeline, monkeypatch, dtype, quantization, pp_size):
    """A verify step (several rows per sequence over its cache) runs in one call too, each row
    attended as a decode row: its hidden states and KV writes are bit for bit those of decoding
    the same tokens one step at a time, and (prompts prefilled on the split-invariant path) those
    of the modules on that path."""
    from stagewise.model import attention
    _needs_op()
    pipe = eager_pipeline(llama_dir, pp_size=pp_size, dtype=dtype, quantization=quantization)
    used = _one_call_count(monkeypatch)

    def same(a, b):
        for seq in range(3):
            for got, ref in zip(a[0][seq], b[0][seq], strict=True):
                assert torch.equal(got, ref), seq
        for got, ref in zip(a[1], b[1], strict=True):
            assert torch.equal(got, ref)
    with torch.no_grad():
        verify = _continue(pipe, 4)
        assert len(used) == pp_size                 # the verify step took the op on every stage
        same(verify, _continue(pipe, 1))
        monkeypatch.setattr(attention, "INVARIANT", True)
        verify = _continue(pipe, 4)
        monkeypatch.setattr(llama, "ONE_CALL_DECODE", False)
        same(verify, _continue(pipe, 4))


def test_float16_stages_use_the_modules(llama_dir, eager_pipeline):
    """The norm, rope and attention kernels serve float32 and bfloat16 only: a float16 stage never plans."""
    _needs_op()
    pipe = eager_pipeline(llama_dir, dtype=torch.float16, quantization="int8")
    assert pipe.stages[0]._plan_decode_layers() is None


def test_the_op_runs_the_cpp_registration():
    _needs_op()
    assert native.loaded("layers")
    dump = torch._C._dispatch_dump("stagewise::decode_layers")
    assert "layers_ops.cpp" in dump.split("\nCPU: ")[1].splitlines()[0]


@pytest.mark.parametrize("registration", ["python", "op"])
def test_bad_lists_are_refused(registration):
    if registration == "op":
        _needs_op()
    call = cpu_layers._decode_layers if registration == "python" else torch.ops.stagewise.decode_layers
    hidden, w = torch.zeros(1, 32), torch.zeros(4, 8, dtype=torch.uint8)
    cache, ids = torch.zeros(2, 1, 4, 1, 8), torch.zeros(1, dtype=torch.long)
    good = dict(norms=[torch.ones(32)] * 2, data=[w] * 4, qtypes=[8] * 4, ns=[16] * 4, parts=[1] * 4, biases=[],
                bias_of=[-1] * 4, caches=[cache])
    bad = [dict(norms=[torch.ones(32)]), dict(parts=[1] * 3), dict(parts=[1, 1, 1, 0]), dict(data=[w] * 5),
           dict(qtypes=[8] * 3), dict(ns=[16] * 5), dict(caches=[]), dict(caches=[cache, cache]),
           dict(bias_of=[-1] * 3), dict(bias_of=[-1, 0, -1, -1]), dict(bias_of=[-2, -1, -1, -1])]
    for change in bad:
        a = {**good, **change}
        with pytest.raises(ValueError, match="stagewise decode_layers: .*it needs, per layer, one KV cache"):
            call(hidden, None, hidden, hidden, ids, ids[None], ids, a["norms"], a["data"], a["qtypes"], a["ns"],
                 a["parts"], a["biases"], a["bias_of"], a["caches"], 1, 1, 1e-5, 1.0, True)
