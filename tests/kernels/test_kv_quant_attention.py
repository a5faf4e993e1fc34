"""The decode kernel over a cache of q8_0/q4_0 blocks (`decode_attention_stored`, csrc/kv_blocks.h)
against the dense decode kernel run on the blocks dequantized to q's dtype: the same bits (tolerance
0: both compute code * scale in float32, rounded to bf16 for a bf16 q, then the same arithmetic)
for head sizes on 8 and 16 lanes, GQA ratios, block tables, lengths and both task layouts; bad
calls raise before any read; paged_attention's decode steps read the blocks with no dense copy.
Run under STAGEWISE_KERNEL_ISA=avx2 and =portable too (.ci/run)."""
import pytest
import torch

from stagewise.kernels import attention as cpu_attention
from stagewise.kernels import build, kv_quant
from stagewise.model import attention as model_attention
from stagewise.model.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")


def _case(fmt, dtype, g, hq, hkv, d, bs, nb, lens, seed):
    """q, a stored cache of random rows (every block's scale differs), disjoint shuffled tables."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, nb, bs, hkv, d, generator=gen) * torch.logspace(-2, 1, nb).view(1, nb, 1, 1, 1)
    perm = torch.randperm(nb, generator=gen)
    x[:, perm[0]] *= 1e-4                                           # fp16 scales below its normals: subnormal
    qtype = kv_quant.QUANTIZED[fmt]
    raw = kv_quant.quantize_rows(x, qtype)
    width = max(-(-n // bs) for n in lens) + 1                       # a spare column: never read
    tables = torch.full((g, width), -7, dtype=torch.int64)          # out-of-range padding: must stay unread
    at = 0
    for i, n in enumerate(lens):
        need = -(-n // bs)
        tables[i, :need] = perm[at:at + need]
        at += need
    q = torch.randn(g, hq, d, generator=gen).to(dtype)
    return q, raw, tables, torch.tensor(lens, dtype=torch.int64), qtype


CASES = [  # g, hq, hkv, d, bs, nb, lens
    (1, 4, 4, 32, 16, 4, [1]),                 # one key, MHA, 8 lanes x 4 (16 on AVX-512)
    (3, 8, 2, 64, 16, 12, [17, 33, 5]),        # GQA 4
    (2, 6, 2, 96, 8, 40, [130, 77]),           # GQA 3, three blocks of 32 a row, odd lengths
    (5, 12, 4, 128, 32, 24, [1, 31, 32, 33, 200]),
    (2, 3, 1, 32, 4, 20, [9, 40]),             # MQA, blocks of 4 keys
]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_equals_dense_kernel_on_dequantized_values(fmt, dtype, case):
    q, raw, tables, lens, qtype = _case(fmt, dtype, *case, seed=CASES.index(case) + 10 * (fmt == "q4_0"))
    d = q.shape[-1]
    dense = kv_quant.dequantize_rows(raw, qtype, d, dtype).contiguous()
    for per_sequence in (True, False):
        ref = cpu_attention.decode_attention(q, dense, tables, lens, d ** -0.5, per_sequence)
        got = cpu_attention.decode_attention_stored(q, raw, tables, lens, d ** -0.5, per_sequence)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # and it is attention over those values: near float64 attention over them (float32 sums; a
    # bf16 output's rounding), the tolerance scaled by the values' size (block scales span 1e-2..10)
    k = dense.double()
    for i, n in enumerate(lens.tolist()):
        rows = tables[i, :-(-n // raw.shape[2])]
        kk, vv = (k[j][rows].reshape(-1, k.shape[3], d)[:n] for j in (0, 1))       # [n, Hkv, D]
        grp = q.shape[1] // k.shape[3]
        qq = q[i].double().view(k.shape[3], grp, d)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", qq, kk) * d ** -0.5, -1)
        want = torch.einsum("hgn,nhd->hgd", p, vv).reshape(-1, d)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got[i].double(), want, rtol=tol, atol=tol * float(vv.abs().max()))


def test_bad_calls_raise_before_reading():
    q, raw, tables, lens, _ = _case("q8_0", torch.float32, 2, 4, 2, 64, 8, 6, [9, 16], seed=3)
    run = cpu_attention.decode_attention_stored
    bad = tables.clone()
    bad[1, 0] = 6                                                    # one past the pool
    with pytest.raises(ValueError, match=r"sequence 1 reads blocks \[6, .*holds blocks 0..5"):
        run(q, raw, bad, lens, 0.1)
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="sequence 1 reads blocks"):
        run(q, raw, bad, lens, 0.1)
    with pytest.raises(ValueError, match=r"sequence 0 has 0 keys"):
        run(q, raw, tables, torch.tensor([0, 16]), 0.1)
    with pytest.raises(ValueError, match=r"sequence 1 has 25 keys.*3 blocks of 8"):
        run(q, raw, tables, torch.tensor([9, 25]), 0.1)
    with pytest.raises(ValueError, match="D / 32 \\* 34 \\(q8_0\\)"):
        run(q, raw[..., :-1].contiguous(), tables, lens, 0.1)       # a row that is no block layout
    with pytest.raises(ValueError, match="D / 32"):
        run(q, raw.float(), tables, lens, 0.1)                      # not uint8
    with pytest.raises(ValueError, match="D / 32"):
        run(q[..., :48], kv_quant.quantize_rows(torch.zeros(2, 6, 8, 2, 64), kv_quant.QUANTIZED["q4_0"]), tables,
            lens, 0.1)                                               # head size off the 32-blocks
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        run(q[:, :3], raw, tables, lens, 0.1)
    with pytest.raises(ValueError, match="one row per query row"):
        run(q, raw, tables[:1], lens, 0.1)
    with pytest.raises(ValueError, match="int64"):
        run(q, raw, tables.int(), lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        run(q, raw.transpose(1, 2), tables, lens, 0.1)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_decode_steps_skip_the_dense_copy(fmt, monkeypatch):
    """paged_attention's plain decode over a stored cache reads the blocks in place (no
    `_dense_cache`) and gives the bits of the dense path; a continued prefill still copies."""
    gen = torch.Generator().manual_seed(5)
    nb, bs, hkv, hq, d = 8, 4, 2, 4, 32
    stored = torch.zeros(2, nb, bs, hkv, kv_quant.last_dim(fmt, d), dtype=torch.uint8)
    tables = [[3, 1, 4], [5, 2, 6]]
    ctx = AttentionMetadata.build([9, 6], [9, 6], tables, bs)
    model_attention.write_kv(stored, ctx.slot_mapping, *(torch.randn(15, hkv, d, generator=gen) for _ in range(2)))
    copies = []
    real = model_attention._dense_cache
    monkeypatch.setattr(model_attention, "_dense_cache", lambda *a: copies.append(1) or real(*a))
    meta = AttentionMetadata.build([1, 1], [10, 7], tables, bs)
    q = torch.randn(3, hq, d, generator=gen)                         # a padding row past the two live ones
    k, v = (torch.randn(3, hkv, d, generator=gen) for _ in range(2))
    got = paged_attention(meta, stored, q, k, v, 0.2)
    assert not copies and got[2].abs().max() == 0
    dense = kv_quant.dequantize_rows(stored, kv_quant.format_of(stored, d), d, torch.float32).contiguous()
    ref = paged_attention(meta, dense, q, k, v, 0.2, kv_written=True)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    paged_attention(AttentionMetadata.build([2, 1], [12, 8], tables, bs), stored, q, k, v, 0.2)
    assert copies
