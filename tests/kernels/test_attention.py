"""The in-place CPU decode kernel against the SDPA reference (which gathers KV blocks): mixed
batches of decode rows, cached prefills, fresh prefills and padded rows, in fp32 and bf16; the
bf16 prefill kernel against causal SDPA."""
import pytest
import torch
import torch.nn.functional as F

from stagewise.kernels import attention as cpu_attention
from stagewise.kernels import build
from stagewise.model import attention as model_attention
from stagewise.model.attention import AttentionMetadata, ForwardBatch, invariant_paged_attention, sdpa_paged_attention

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")
# where the CPU has AVX512-BF16 the prefill kernel must exist: skipped only where the CPU lacks it
needs_native_bf16 = pytest.mark.skipif(not build.native_bf16(),
                                       reason="the prefill kernel needs native bf16 (AVX512-BF16)")

BS, HKV, HQ, D, NUM_BLOCKS = 16, 2, 6, 32, 96


def _tables(seq_lens, seed):
    """Disjoint, shuffled block tables (block 0 stays the scratch block)."""
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables, i = [], 0
    for s in seq_lens:
        n = -(-s // BS)
        tables.append(perm[i:i + n])
        i += n
    return tables


def _both(query_lens, seq_lens, dtype, pad_rows=0, seed=0, d=D, kernel="in_place_decode"):
    gen = torch.Generator().manual_seed(seed)
    meta = AttentionMetadata.build(query_lens, seq_lens, _tables(seq_lens, seed), BS)
    rows = meta.num_tokens + pad_rows
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, d, generator=gen).to(dtype)
    q, k, v = (torch.randn(rows, h, d, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = sdpa_paged_attention(meta, ref_cache, q, k, v, d ** -0.5)
    got = sdpa_paged_attention(meta, got_cache, q, k, v, d ** -0.5, **{kernel: True})
    assert torch.equal(ref_cache, got_cache)      # the same KV written
    return ref.float(), got.float()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", [
    ([1] * 5, [1, 17, 33, 64, 90]),                   # all decode, several lengths (grouped by length)
    ([1] * 4, [40, 40, 40, 40]),                      # all decode in batch order (the no-scatter path)
    ([1, 6, 1, 9, 1], [20, 30, 77, 9, 5]),            # decode + cached prefill + fresh prefill
])
def test_in_place_decode_equals_sdpa(case, dtype, tol):
    ref, got = _both(*case, dtype)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_head_sizes_that_are_not_a_multiple_of_16(dtype, tol):
    """8-lane vectors serve head sizes of 8k (AVX-512 CPUs take 16 lanes where D allows)."""
    ref, got = _both([1] * 5, [1, 17, 33, 64, 90], dtype, d=24)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@needs_native_bf16
@pytest.mark.parametrize("case", [
    ([1], [1]), ([7], [7]), ([48, 3, 49], [48, 3, 49]), ([100], [100]),    # one-row tiles to 48-row blocks
    ([1, 6, 1, 9, 20], [20, 30, 77, 9, 20]),                                 # mixed with decode and cached prefill
])
def test_prefill_kernel_equals_causal_sdpa(case):
    """Fresh prompts through the bf16 prefill kernel against causal SDPA (bf16 rounding: the
    kernel rounds the probabilities to bf16 before the sum over values)."""
    ref, got = _both(*case, torch.bfloat16, pad_rows=2, kernel="prefill_kernel")
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
    assert got[-2:].abs().max() == 0


@needs_native_bf16
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (8, 8, 32)])
def test_prefill_kernel_is_as_accurate_as_bf16_sdpa(hq, hkv, d):
    """Against float32 attention on the same bf16 inputs, the kernel's error stays within bf16
    SDPA's own (the probabilities enter the sum over values as bf16 (hi, lo) pairs; rounding them
    to one bf16 each measured 1.4x SDPA's error)."""
    gen = torch.Generator().manual_seed(hq + d)
    for n in (5, 45, 200):
        q, k, v = (torch.randn(n, h, d, generator=gen).bfloat16() for h in (hq, hkv, hkv))
        as_bhnd = lambda x, dt: x.to(dt).transpose(0, 1)[None]                       # noqa: E731
        exact, sdpa = (F.scaled_dot_product_attention(as_bhnd(q, dt), as_bhnd(k, dt), as_bhnd(v, dt), is_causal=True,
                                                      scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1).float()
                       for dt in (torch.float32, torch.bfloat16))
        got = cpu_attention.prefill_attention(q, k, v, d ** -0.5).float()
        assert (got - exact).abs().max() <= 1.1 * (sdpa - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_task_per_sequence_equals_task_per_head(dtype):
    """The two task layouts (picked by batch size against the thread count) agree bit for bit."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, 17, 33, 64, 90, 5]
    tables = _tables(seq_lens, 5)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens), HQ, D, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    by_seq = cpu_attention.decode_attention(q, cache, block_tables, lens, 0.3, per_sequence=True)
    by_head = cpu_attention.decode_attention(q, cache, block_tables, lens, 0.3, per_sequence=False)
    assert torch.equal(by_seq, by_head)


def test_padded_rows_stay_zero():
    ref, got = _both([1, 1, 7], [12, 50, 7], torch.float32, pad_rows=3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got[-3:].abs().max() == 0


def test_engine_attention_uses_the_kernel(monkeypatch):
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    meta = AttentionMetadata.build([1, 1], [5, 9], _tables([5, 9], 1), BS)
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    q, k, v = torch.randn(2, HQ, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    ForwardBatch(meta, [cache]).attention(0, q, k, v, 1.0)
    assert calls == [1]


@pytest.fixture
def invariant(monkeypatch):
    """INVARIANT on (as with the engine's invariant_attention): metadata carries the per-row spans."""
    monkeypatch.setattr(model_attention, "INVARIANT", True)


def _chunked(n, cuts, dtype, d, seed=3):
    """One prompt of n rows attended as chunks ending at `cuts` (+ n) through `invariant_paged_attention`;
    the rows in prompt order."""
    gen = torch.Generator().manual_seed(seed)
    table = _tables([n], seed)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, d, dtype=dtype)
    outs, start = [], 0
    for end in [*cuts, n]:
        meta = AttentionMetadata.build([end - start], [end], table, BS)
        outs.append(invariant_paged_attention(meta, cache, q[start:end], k[start:end], v[start:end], d ** -0.5))
        start = end
    return torch.cat(outs), (q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [24, 32])       # 8-lane vectors; 16 lanes on AVX-512 CPUs
def test_invariant_attention_does_not_depend_on_the_chunks(dtype, d, invariant):
    """A prompt of 57 rows in one chunk, in chunks of 16 and of 7, and with a decode-sized last chunk:
    every row the same bits (and close to causal SDPA)."""
    whole, (q, k, v) = _chunked(57, [], dtype, d)
    for cuts in ([16, 32, 48], list(range(7, 57, 7)), [56], [1, 2, 40]):
        assert torch.equal(_chunked(57, cuts, dtype, d)[0], whole), cuts
    ref = F.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                         scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), ref, rtol=tol, atol=tol)


def test_invariant_attention_rows_do_not_depend_on_the_batch(invariant):
    """A mixed step (decode rows, a continued prefill, a fresh prompt, padding rows): each row equals
    the same query attended alone as a one-token decode, and padding rows are zero."""
    query_lens, seq_lens = [1, 6, 1, 9], [20, 30, 77, 9]
    gen = torch.Generator().manual_seed(9)
    tables = _tables(seq_lens, 9)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BS)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=gen)
    q, k, v = (torch.randn(meta.num_tokens + 2, h, D, generator=gen) for h in (HQ, HKV, HKV))
    got = invariant_paged_attention(meta, cache, q, k, v, 0.2)
    assert got[-2:].abs().max() == 0
    row = 0
    for tab, q_len, s_len in zip(tables, query_lens, seq_lens):
        for pos in range(s_len - q_len, s_len):
            alone = cpu_attention.decode_attention(q[row:row + 1], cache, torch.tensor([tab]), torch.tensor([pos + 1]),
                                                   0.2)
            assert torch.equal(got[row:row + 1], alone)
            row += 1


def test_engine_attention_takes_the_invariant_path(monkeypatch, invariant):
    """With INVARIANT (the engine's invariant_attention), steps that are not plain decode go through
    `invariant_paged_attention` (one kernel call)."""
    calls = []
    real = cpu_attention.rows_attention
    monkeypatch.setattr(cpu_attention, "rows_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    meta = AttentionMetadata.build([1, 7], [5, 7], _tables([5, 7], 1), BS)
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    q, k, v = torch.randn(8, HQ, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    ForwardBatch(meta, [cache]).attention(0, q, k, v, 1.0)
    assert calls == [8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [24, 32])
def test_rows_kernel_gives_each_row_its_decode_bits(dtype, d):
    """Rows in spans sharing a block table (up to 64 rows, lengths rising, a decode row of another
    sequence, per-span and per-head tasks) = each row alone through the decode kernel, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    tables = _tables([100, 60], 11)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, d, generator=gen).to(dtype)
    lens = list(range(31, 101)) + [60]                  # 70 rows of one prompt (positions 30..99), a decode row
    q = torch.randn(len(lens), HQ, d, generator=gen).to(dtype)
    width = max(map(len, tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    for spans, owners in (([0, 64, 70, 71], [0, 0, 1]), ([0, 1, 17, 70, 71], [0, 0, 0, 1])):
        got = cpu_attention.rows_attention(q, cache, torch.tensor([padded[o] for o in owners]), torch.tensor(spans),
                                           torch.tensor(lens), 0.3)
        for i, n in enumerate(lens):
            alone = cpu_attention.decode_attention(q[i:i + 1], cache, torch.tensor([padded[0 if i < 70 else 1]]),
                                                   torch.tensor([n]), 0.3)
            assert torch.equal(got[i:i + 1], alone), (spans, i)


@pytest.mark.parametrize("spans,lens,words", [
    ([0, 65], list(range(1, 66)), "by 1..64"),          # a span of more than 64 rows
    ([0, 2, 2, 3], [3, 4, 5], "by 1..64"),              # an empty span
    ([0, 2], [3, 4, 5], "rise from 0"),                 # spans that do not cover the rows
    ([0, 3], [3, 400, 5], "length outside"),            # a row longer than its table
])
def test_rows_kernel_refuses_bad_spans(spans, lens, words):
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    n_spans = len(spans) - 1
    tables = torch.tensor([[1, 2, 3]] * n_spans)
    q = torch.zeros(len(lens), HQ, D)
    with pytest.raises(ValueError, match=words):
        cpu_attention.rows_attention(q, cache, tables, torch.tensor(spans), torch.tensor(lens), 0.3)


def test_rows_kernel_refuses_blocks_outside_the_pool():
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    with pytest.raises(ValueError, match="blocks outside"):
        cpu_attention.rows_attention(torch.zeros(2, HQ, D), cache, torch.tensor([[1, NUM_BLOCKS]]),
                                     torch.tensor([0, 2]), torch.tensor([3, 20]), 0.3)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
                         ids=["avx2", "portable"])
def test_narrower_builds_keep_rows_equal_to_decode(flags):
    """The AVX2 and portable builds of attention.c: the rows entry gives each row its decode bits too."""
    import ctypes
    lib = build.library("attention", ["attention.c"], flags)
    i64, p, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    gen = torch.Generator().manual_seed(2)
    table = torch.tensor(_tables([100], 2)[0])
    lens = torch.arange(31, 101)
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        dec, rows = getattr(lib, f"decode_attention_{name}"), getattr(lib, f"decode_attention_{name}_rows")
        dec.argtypes = [p, i64, p, p, i64, i64, p, i64, i64, p, i64, i64, i64, i64, i64, f32, i64, p]
        rows.argtypes = [p, i64, p, p, i64, i64, p, i64, i64, p, i64, p, i64, i64, i64, i64, i64, f32, i64, p]
        dec.restype = rows.restype = i64
        cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=gen).to(dtype)
        q = torch.randn(70, HQ, D, generator=gen).to(dtype)
        got, ref = q.new_empty(q.shape), q.new_empty(q.shape)
        spans, per_span = torch.tensor([0, 16, 32, 64, 70]), table[None].expand(4, -1).contiguous()
        per_row = table[None].expand(70, -1).contiguous()
        common = (q.data_ptr(), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(), BS * HKV * D, NUM_BLOCKS)
        assert rows(*common, per_span.data_ptr(), per_span.stride(0), table.numel(), lens.data_ptr(), 70,
                    spans.data_ptr(), 4, HQ, HKV, D, BS, 0.3, HKV, got.data_ptr()) == 0
        assert dec(*common, per_row.data_ptr(), per_row.stride(0), table.numel(), lens.data_ptr(), 70, HQ, HKV, D, BS,
                   0.3, 1, ref.data_ptr()) == 0
        assert torch.equal(got, ref), name
