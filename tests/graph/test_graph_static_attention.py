"""Static-shape paged attention (full graphs) equals the reference SDPA paged attention."""
import pytest
import torch

from stagewise.graph.static_attention import StaticAttentionMetadata, StaticForwardBatch
from stagewise.model.attention import AttentionMetadata, ForwardBatch, sdpa_paged_attention

BS, NB, HQ, HKV, D = 4, 16, 4, 2, 8


def _case(query_lens, seq_lens, tables, bucket, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NB, BS, HKV, D, generator=g)
    cache[:, 0] = 0.0
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BS)
    q = torch.randn(bucket, HQ, D, generator=g)
    k = torch.randn(bucket, HKV, D, generator=g)
    v = torch.randn(bucket, HKV, D, generator=g)
    ref_cache = cache.clone()
    ref = sdpa_paged_attention(meta, ref_cache, q, k, v, 0.3)
    static = StaticAttentionMetadata(max_rows=32, max_slots=8, max_blocks=6, block_size=BS)
    static.fill(meta, bucket, slots)
    batch = StaticForwardBatch(ForwardBatch(meta, [cache]), static, bucket, slots)
    out = batch.attention(0, q, k, v, 0.3)
    return out, ref, cache, ref_cache


@pytest.mark.parametrize("query_lens,seq_lens,tables,bucket", [
    ([1, 1, 1], [5, 9, 2], [[1, 2], [3, 4, 5], [6]], 4),              # decode, padded to 4
    ([7], [7], [[1, 2]], 8),                                           # one prefill
    ([3, 1, 5], [10, 4, 5], [[1, 2, 3], [4], [5, 6]], 12),             # mixed, prefix cached
    ([2, 2], [2, 2], [[1], [2]], 4),                                   # exactly full bucket
])
def test_static_attention_matches_reference(query_lens, seq_lens, tables, bucket):
    out, ref, cache, ref_cache = _case(query_lens, seq_lens, tables, bucket, slots=4)
    T = sum(query_lens)
    torch.testing.assert_close(out[:T], ref[:T], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[T:]) == 0
    # same KV everywhere except scratch block 0, where padded rows land
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:])


def test_static_attention_rejects_more_requests_than_slots():
    meta = AttentionMetadata.build([1, 1, 1], [2, 2, 2], [[1], [2], [3]], BS)
    static = StaticAttentionMetadata(max_rows=8, max_slots=2, max_blocks=2, block_size=BS)
    with pytest.raises(RuntimeError, match="unservable"):
        static.fill(meta, 4, 2)


def test_static_attention_reset_writes_only_scratch():
    cache = torch.randn(2, NB, BS, HKV, D)
    before = cache.clone()
    static = StaticAttentionMetadata(max_rows=8, max_slots=2, max_blocks=2, block_size=BS)
    static.reset()
    batch = StaticForwardBatch(ForwardBatch(None, [cache]), static, 8, 2)
    out = batch.attention(0, torch.randn(8, HQ, D), torch.randn(8, HKV, D), torch.randn(8, HKV, D), 1.0)
    assert torch.count_nonzero(out) == 0 and torch.isfinite(out).all()
    torch.testing.assert_close(cache[:, 1:], before[:, 1:])
    torch.testing.assert_close(cache[:, 0, 1:], before[:, 0, 1:])
