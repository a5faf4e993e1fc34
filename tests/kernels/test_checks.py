"""Every kernel op checks its arguments before touching memory: a bad call is a ValueError that
says what was wrong (dtype, shape, contiguity, K, block ids past the pool, lengths past the block
tables), never an out-of-bounds read. Called directly and through `torch.ops.stagewise`."""
import pytest
import torch

from stagewise.kernels import attention, build, gemm

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")


@pytest.mark.parametrize("x,w,b", [
    (torch.randn(2, 64), torch.randn(8, 72), None),                        # K differs
    (torch.randn(2, 64), torch.randn(8, 64).bfloat16(), None),             # dtypes differ
    (torch.randn(2, 64).double(), torch.randn(8, 64).double(), None),      # dtype without a kernel
    (torch.randn(2, 60), torch.randn(8, 60), None),                        # K not a multiple of 8
    (torch.randn(2, 64), torch.randn(64, 8).t(), None),                    # weight not contiguous
    (torch.randn(64, 2).t(), torch.randn(8, 64), None),                    # x columns strided
    (torch.randn(64), torch.randn(8, 64), None),                           # x not 2-D
    (torch.randn(2, 64), torch.randn(8, 64), torch.randn(9)),              # bias of another N
])
def test_small_linear_refuses(x, w, b):
    with pytest.raises(ValueError, match="stagewise linear kernel: x"):
        gemm.small_linear(x, w, b)


@pytest.mark.parametrize("call", [gemm._packed, torch.ops.stagewise.linear_packed])
def test_packed_linear_refuses(call):
    dtype = torch.float32                     # every build has the packed float32 kernel
    n = 2 * gemm.layout(dtype)[0]
    w = gemm.pack(torch.randn(n, 64, dtype=dtype))
    with pytest.raises(ValueError, match="stagewise packed linear kernel"):
        call(torch.randn(3, 72, dtype=dtype), w, None)                     # K differs
    with pytest.raises(ValueError, match="stagewise packed linear kernel"):
        call(torch.randn(3, 64, dtype=dtype), w, torch.randn(n + 1))       # bias of another N
    with pytest.raises(ValueError, match="stagewise packed linear kernel"):
        call(torch.randn(3, 64).double(), w.double(), None)                # no packed float64
    with pytest.raises(ValueError, match="stagewise packed linear kernel"):
        call(torch.randn(3, 64, dtype=dtype), torch.randn(64, n, dtype=dtype).t(), None)   # not contiguous


BS, NB, HKV, HQ, D = 4, 6, 2, 4, 16


def _decode_args(tables, lens, **over):
    args = dict(q=torch.randn(len(lens), HQ, D), kv_cache=torch.randn(2, NB, BS, HKV, D),
                block_tables=torch.tensor(tables, dtype=torch.int64), seq_lens=torch.tensor(lens, dtype=torch.int64))
    args.update(over)
    return args


@pytest.mark.parametrize("tables,lens,words", [
    ([[1, 2], [3, 6]], [5, 8], r"sequence 1 reads blocks \[3, 6\], but the cache holds blocks 0..5"),
    ([[1, 2], [3, -1]], [5, 8], r"sequence 1 reads blocks \[3, -1\]"),
    ([[1, 2], [3, 4]], [5, 9], "sequence 1 has 9 keys, but its block table row holds 2 blocks of 4"),
    ([[1, 2], [3, 4]], [0, 3], "sequence 0 has 0 keys"),
])
def test_decode_attention_refuses_tables_outside_the_pool(tables, lens, words):
    """Entries past a sequence's length are never read, so only those it uses are checked."""
    assert torch.isfinite(attention.decode_attention(**_decode_args([[1, 2], [3, 99]], [5, 4]), scale=0.25)).all()
    with pytest.raises(ValueError, match=words):
        attention.decode_attention(**_decode_args(tables, lens), scale=0.25)


@pytest.mark.parametrize("over,words", [
    (dict(block_tables=torch.tensor([[1], [2]], dtype=torch.int32)), "block_tables must be int64"),
    (dict(block_tables=torch.tensor([[1]])), "one row per query row"),
    (dict(seq_lens=torch.tensor([3])), "seq_lens must be int64 \\[G\\]"),
    (dict(kv_cache=torch.randn(2, NB, BS, HKV, D).bfloat16()), "one dtype"),
    (dict(kv_cache=torch.randn(2, NB, BS, D, HKV).transpose(3, 4)), "contiguous"),
    (dict(kv_cache=torch.randn(2, NB, BS, HKV, 2 * D)), "head size must match"),
    (dict(kv_cache=torch.randn(2, NB, BS, 3, D)), "Hq a multiple of Hkv"),
    (dict(q=torch.randn(2, HQ * D)), r"q must be \[G, Hq, D\]"),
])
def test_decode_attention_refuses_bad_shapes(over, words):
    with pytest.raises(ValueError, match=words):
        attention.decode_attention(**_decode_args([[1, 2], [3, 4]], [5, 8], **over), scale=0.25)


@pytest.mark.parametrize("q,k,v", [
    (torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)),                  # float32
    (torch.randn(5, 4, 16).bfloat16(), torch.randn(4, 2, 16).bfloat16(), torch.randn(4, 2, 16).bfloat16()),
    (torch.randn(5, 4, 16).bfloat16(), torch.randn(5, 2, 16).bfloat16(), torch.randn(5, 1, 16).bfloat16()),
    (torch.randn(5, 4, 24).bfloat16(), torch.randn(5, 2, 24).bfloat16(), torch.randn(5, 2, 24).bfloat16()),
])
def test_prefill_attention_refuses(q, k, v):
    with pytest.raises(ValueError, match="stagewise prefill attention"):
        attention.prefill_attention(q, k, v, 0.25)
