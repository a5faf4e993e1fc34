"""The rope kernel (csrc/rope.c) against model/layers.py `apply_rotary_full` and attention.py
`write_kv`, in every build: the same bits (float32 and bfloat16) over many shapes and positions,
the KV cache written at the slots and nowhere else, bad arguments refused with a ValueError, and
the model's eager attention using it."""

import ctypes

import pytest
import torch

from stagewise.kernels import build, native
from stagewise.kernels import rope as cpu_rope
from stagewise.model.attention import write_kv
from stagewise.model.layers import RotaryEmbedding, apply_rotary_full

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")

BUILDS = {"avx512": ("-mno-avx512bf16",), "avx2": ("-mno-avx512f",),
          "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
# (heads, kv_heads, head size): MHA, GQA, MQA; head sizes below, at and past a vector
SHAPES = [(1, 1, 2), (3, 1, 8), (4, 2, 16), (9, 3, 64), (2, 2, 30), (8, 1, 128), (5, 5, 34)]
DTYPES = [torch.float32, torch.bfloat16]
BLOCKS, BLOCK_SIZE = 6, 4


def _case(rows, hq, hkv, d, dtype, seed, *, wide=False):
    """qkv rows (a column slice of a wider tensor where `wide`), the tables of a real
    RotaryEmbedding at random positions, a filled KV cache and distinct slots."""
    gen = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    qkv = (torch.randn(rows, width + (7 if wide else 0), generator=gen) * 4).to(dtype)
    if wide:
        qkv = qkv[:, 3:3 + width]
    rotary = RotaryEmbedding(d, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = rotary.tables(positions, dtype)                      # [rows, 1, D]
    cache = torch.randn(2, BLOCKS, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:min(rows, BLOCKS * BLOCK_SIZE)]
    return qkv, cos, sin, cache, slots


def _reference(qkv, cos, sin, hq, hkv, cache, slots):
    """model/llama.py's PyTorch path: apply_rotary_full on the q and k columns, then write_kv."""
    rows, d = qkv.shape[0], cos.shape[-1]
    qk = apply_rotary_full(qkv[:, :(hq + hkv) * d].view(rows, hq + hkv, d), cos, sin)
    cache = cache.clone()
    n = slots.numel()
    write_kv(cache, slots, qk[:n, hq:], qkv[:, (hq + hkv) * d:].view(rows, hkv, d)[:n])
    return (qk[:, :hq], qk[:, hq:]), cache


def _assert_same(got, ref):
    if isinstance(got, tuple):         # (q, k)
        assert len(got) == len(ref) == 2 and all(g.is_contiguous() for g in got)
        _assert_same(got[0], ref[0])
        _assert_same(got[1], ref[1])
        return
    assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref), \
        (got.float() - ref.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_kernel_matches_the_pytorch_path(dtype, hq, hkv, d):
    for seed, rows in enumerate((1, 2, 5, 13, 40)):
        qkv, cos, sin, cache, slots = _case(rows, hq, hkv, d, dtype, seed, wide=seed % 2 == 1)
        ref, ref_cache = _reference(qkv, cos, sin, hq, hkv, cache, slots)
        got = cpu_rope.rope_kv(qkv, cos, sin, hq, hkv, cache, slots)
        _assert_same(got, ref)
        _assert_same(cache, ref_cache)                   # the slots, and nothing else
        _assert_same(cpu_rope.rope_kv(qkv, cos[:, 0], sin[:, 0], hq, hkv), ref)   # [T, D] tables, no cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_fewer_slots_than_rows_and_special_values(dtype):
    """Only the first n rows (the live ones) go to the cache; inf, -0.0 and huge values round as PyTorch."""
    hq, hkv, d = 4, 2, 16
    qkv, cos, sin, cache, _ = _case(9, hq, hkv, d, dtype, 3)
    qkv[0, :4] = torch.tensor([float("inf"), -0.0, 3e38, -3e38]).to(dtype)
    qkv[1, 5] = torch.finfo(dtype).tiny
    slots = torch.tensor([23, 0, 11], dtype=torch.int64)
    ref, ref_cache = _reference(qkv, cos, sin, hq, hkv, cache, slots)
    got = cpu_rope.rope_kv(qkv, cos, sin, hq, hkv, cache, slots)
    for g, r in zip(got, ref):
        assert torch.equal(g.nan_to_num(), r.nan_to_num()) and torch.equal(g.isnan(), r.isnan())
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_split_over_threads(dtype):
    """Past the team's threshold rows split over threads: the same bits as one row at a time."""
    hq, hkv, d = 9, 3, 64
    qkv, cos, sin, cache, _ = _case(600, hq, hkv, d, dtype, 5)
    big_cache = torch.zeros(2, 200, 4, hkv, d, dtype=dtype)
    slots = torch.randperm(800)[:600]
    ref, ref_cache = _reference(qkv, cos, sin, hq, hkv, big_cache, slots)
    got = cpu_rope.rope_kv(qkv, cos, sin, hq, hkv, big_cache, slots)
    _assert_same(got, ref)
    _assert_same(big_cache, ref_cache)


def test_both_registrations_agree():
    if not native.loaded("rope"):
        pytest.skip("the C++ registration did not build")
    for dtype in DTYPES:
        qkv, cos, sin, cache, slots = _case(5, 3, 1, 32, dtype, 9, wide=True)
        other = cache.clone()
        a = cpu_rope._rope_kv(qkv, cos, sin, 3, 1, cache, slots)
        b = torch.ops.stagewise.rope_kv(qkv, cos, sin, 3, 1, other, slots)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(cache, other)


def _build(name):
    flags = BUILDS[name]
    if name == "avx512" and "avx512f" not in build.cpu_flags():
        pytest.skip("the CPU has no AVX-512")
    if name == "avx2" and not {"avx2", "fma"} <= build.cpu_flags():
        pytest.skip("the CPU has no AVX2")
    lib = build.library("rope", ["rope.c"], flags)
    assert lib is not None
    cpu_rope.bind(lib)
    return lib


def _run(lib, qkv, cos, sin, hq, hkv, cache, slots):
    rows, d = qkv.shape[0], cos.shape[-1]
    q, k = qkv.new_empty(rows, hq, d), qkv.new_empty(rows, hkv, d)
    fn = lib.rope_kv_f32 if qkv.dtype == torch.float32 else lib.rope_kv_bf16
    bad = fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), q.data_ptr(), k.data_ptr(),
             rows, hq, hkv, d, cache.data_ptr(), cache.shape[1] * cache.shape[2], slots.data_ptr(), slots.numel())
    assert bad == -1
    return q, k


@pytest.mark.parametrize("isa", list(BUILDS))
def test_every_build_gives_the_same_bits(isa):
    """AVX-512, AVX2 and portable builds: each gives PyTorch's bits (no FMA contraction in any)."""
    lib = _build(isa)
    expected = {"avx512": {"avx512f"}, "avx2": {"avx2"}, "portable": set()}[isa]
    assert expected <= build.isa_of(lib) and ("avx512f" in build.isa_of(lib)) == (isa == "avx512")
    assert isa != "portable" or "avx2" not in build.isa_of(lib)
    for dtype in DTYPES:
        for seed, (hq, hkv, d) in enumerate(SHAPES):
            qkv, cos, sin, cache, slots = _case(7, hq, hkv, d, dtype, 100 + seed, wide=True)
            ref, ref_cache = _reference(qkv, cos, sin, hq, hkv, cache, slots)
            _assert_same(_run(lib, qkv, cos, sin, hq, hkv, cache, slots), ref)
            _assert_same(cache, ref_cache)


def test_a_slot_outside_the_cache_writes_nothing():
    lib = _build("portable")
    qkv, cos, sin, cache, _ = _case(4, 2, 1, 8, torch.float32, 1)
    for bad in (-1, BLOCKS * BLOCK_SIZE, 1 << 40):
        slots = torch.tensor([0, 5, bad, 7])
        before = cache.clone()
        with pytest.raises(ValueError, match=f"slot {bad} \\(row 2\\) is outside the KV cache's 24 slots"):
            cpu_rope.rope_kv(qkv, cos, sin, 2, 1, cache, slots)
        assert torch.equal(cache, before)
        q, k = torch.empty(4, 2, 8), torch.empty(4, 1, 8)
        assert lib.rope_kv_f32(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), 8, q.data_ptr(),
                               k.data_ptr(), 4, 2, 1, 8, cache.data_ptr(), 24, slots.data_ptr(), 4) == 2
        assert torch.equal(cache, before)


@pytest.mark.parametrize("registration", ["python", "op"])
def test_bad_arguments_are_refused(registration):
    if registration == "op" and not (cpu_rope.available() and native.loaded("rope")):
        pytest.skip("the C++ registration did not build")
    call = cpu_rope._rope_kv if registration == "python" else torch.ops.stagewise.rope_kv
    qkv, cos, sin, cache, slots = _case(4, 2, 1, 8, torch.float32, 0)
    bad = [
        (qkv.double(), cos.double(), sin.double(), 2, 1, None, None),    # dtype
        (qkv.half(), cos.half(), sin.half(), 2, 1, None, None),
        (qkv, cos.bfloat16(), sin.bfloat16(), 2, 1, None, None),         # tables' dtype
        (qkv, cos, sin.bfloat16(), 2, 1, None, None),
        (qkv, cos, sin, 3, 1, None, None),                               # heads do not add up
        (qkv, cos, sin, 0, 2, None, None),
        (qkv[:, :30], cos[..., :6], sin[..., :6], 2, 1, None, None),    # width not (2 + 2 * 1) * 6
        (qkv[:, :20], cos[..., :5], sin[..., :5], 1, 1, None, None),    # odd head size
        (qkv, cos[:3], sin[:3], 2, 1, None, None),                       # table rows
        (qkv, cos, sin.transpose(0, 1), 2, 1, None, None),              # sin not laid out as cos
        (qkv, cos.expand(4, 2, 8), sin.expand(4, 2, 8), 2, 1, None, None),   # [T, 2, D]
        (qkv.t().contiguous().t(), cos, sin, 2, 1, None, None),          # columns not contiguous
        (qkv[None], cos, sin, 2, 1, None, None),                         # not 2-D
        (qkv, cos, sin, 2, 1, cache, None),                              # cache without slots
        (qkv, cos, sin, 2, 1, None, slots),
        (qkv, cos, sin, 2, 1, cache.bfloat16(), slots),                  # cache dtype
        (qkv, cos, sin, 2, 1, cache[:, :, :, :, :4], slots),             # cache head size
        (qkv, cos, sin, 2, 1, cache.transpose(1, 2), slots),             # cache not contiguous
        (qkv, cos, sin, 2, 1, cache[0], slots),                          # not [2, ...]
        (qkv, cos, sin, 2, 1, cache, slots.int()),                       # slots dtype
        (qkv, cos, sin, 2, 1, cache, slots.repeat(2)[:5]),               # more slots than rows
        (qkv, cos, sin, 2, 1, cache, slots[None]),                       # slots not 1-D
    ]
    for args in bad:
        with pytest.raises(ValueError, match="stagewise rope_kv: .*it needs CPU float32 or bfloat16"):
            call(*args)


def test_the_op_runs_the_cpp_registration():
    """Wherever the C kernel builds (and a C++ compiler exists), the op's CPU kernel is rope_ops.cpp's."""
    if build.cxx_compiler() is None:
        pytest.skip("no C++ compiler")
    assert cpu_rope.available() and native.loaded("rope")
    dump = torch._C._dispatch_dump("stagewise::rope_kv")
    assert "rope_ops.cpp" in dump.split("\nCPU: ")[1].splitlines()[0]


def test_bind_sets_every_entry_point():
    lib = _build("portable")
    assert lib.rope_kv_f32.restype is ctypes.c_int64 and len(lib.rope_kv_bf16.argtypes) == 15


def _attention_steps(layer, rotary, dtype):
    """A 5-token prompt then two decode steps through `layer` with a ForwardBatch: the outputs and
    the KV cache at the end."""
    from stagewise.model.attention import AttentionMetadata, ForwardBatch
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 4, 4, layer.num_kv_heads, layer.head_dim, dtype=dtype)
    batch = ForwardBatch(None, [cache])
    outs = []
    for start, n in ((0, 5), (5, 1), (6, 1)):
        batch.meta = AttentionMetadata.build([n], [start + n], [[2, 0]], 4)
        cos, sin = rotary.tables(torch.arange(start, start + n), dtype)
        outs.append(layer(torch.randn(n, 48, generator=gen).to(dtype), cos, sin, batch))
    return outs, cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_attention_uses_the_op_in_eager_mode(dtype, monkeypatch):
    """LlamaAttention's eager CPU path calls the op once per step (and attention writes no KV of
    its own); with the kernel unavailable it runs PyTorch's ops, to the same bits."""
    from types import SimpleNamespace

    from stagewise.model import attention as paged
    from stagewise.model.llama import LlamaAttention
    config = SimpleNamespace(num_attention_heads=3, num_key_value_heads=1, head_dim=16, hidden_size=48,
                             rms_norm_eps=1e-5)
    torch.manual_seed(1)
    layer = LlamaAttention(config, 0, dtype, qkv_bias=True, o_bias=False, qk_norm=False)
    for p in layer.parameters():
        p.data = torch.randn_like(p, dtype=torch.float32).mul(0.3).to(dtype)
    rotary = RotaryEmbedding(16, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    calls, writes = [], []
    real_rope, real_write = cpu_rope.rope_kv, paged.write_kv
    monkeypatch.setattr(cpu_rope, "rope_kv", lambda *a: calls.append(1) or real_rope(*a))
    monkeypatch.setattr(paged, "write_kv", lambda *a: writes.append(1) or real_write(*a))
    with torch.no_grad():
        outs, cache = _attention_steps(layer, rotary, dtype)
        assert len(calls) == 3 and not writes
        monkeypatch.setattr(cpu_rope, "available", lambda: False)
        ref_outs, ref_cache = _attention_steps(layer, rotary, dtype)
    assert len(calls) == 3 and len(writes) == 3
    for got, ref in zip(outs, ref_outs):
        _assert_same(got, ref)
    _assert_same(cache, ref_cache)


def test_the_fake_gives_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        qkv, cos = mode.from_tensor(torch.empty(3, 5 * 16)), mode.from_tensor(torch.empty(3, 1, 16))
        q, k = torch.ops.stagewise.rope_kv(qkv, cos, cos, 3, 1, None, None)
    assert q.shape == (3, 3, 16) and k.shape == (3, 1, 16)
