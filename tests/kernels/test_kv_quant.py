"""The quantized KV cache's formats (kernels/kv_quant.py, --kv-cache-dtype): q8_0/q4_0 rows are
byte for byte gguf-py's blocks and dequantize to gguf-py's values; paged attention over a quantized
cache equals attention over a dense cache holding the same (dequantized) values; the flag's
validation; the plan's bytes per token against bf16."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stagewise.config import CacheConfig
from stagewise.kernels import kv_quant
from stagewise.model.attention import AttentionMetadata, paged_attention, write_kv
from stagewise.parallel.partition import StageInfo
from stagewise.planning.memory import kv_bytes_per_block

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType as G  # noqa: E402

FORMATS = [("q8_0", G.Q8_0, 34), ("q4_0", G.Q4_0, 18)]


@pytest.mark.parametrize("name,gtype,block_bytes", FORMATS)
def test_rows_are_gguf_blocks(name, gtype, block_bytes):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.logspace(-3, 2, 5).view(5, 1, 1)
    x[0, 0, :32] = 0                                   # an all-zero block: scale 0
    x[1, 1, 7] = -x[1, 1, :32].abs().max() * 2         # q4_0's signed peak
    qtype = kv_quant.QUANTIZED[name]
    raw = kv_quant.quantize_rows(x, qtype)
    assert raw.dtype == torch.uint8 and raw.shape == (5, 3, 64 // 32 * block_bytes)
    oracle = gguf_quants.quantize(x.reshape(-1, 64).numpy(), gtype)
    np.testing.assert_array_equal(raw.reshape(-1, raw.shape[-1]).numpy(), oracle)
    back = kv_quant.dequantize_rows(raw, qtype, 64, torch.float32)
    np.testing.assert_array_equal(back.reshape(-1, 64).numpy(), gguf_quants.dequantize(oracle, gtype))
    # and the round trip is within a step of each block's scale (half a step, the fp16 scale's
    # rounding, and q4_0's one-sided range: -8..7 steps, the peak at -8)
    step = x.reshape(-1, 2, 32).abs().amax(-1, keepdim=True) / (127 if name == "q8_0" else 8)
    err = (back - x).reshape(-1, 2, 32).abs()
    assert (err <= step * (0.6 if name == "q8_0" else 1.0)).all()


def test_a_bad_call_is_an_exception():
    qtype = kv_quant.QUANTIZED["q8_0"]
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_quant.quantize_rows(torch.zeros(2, 48), qtype)
    with pytest.raises(ValueError, match="rows of 68 bytes"):
        kv_quant.dequantize_rows(torch.zeros(2, 34, dtype=torch.uint8), qtype, 64, torch.float32)
    with pytest.raises(ValueError, match="expected uint8"):
        kv_quant.dequantize_rows(torch.zeros(2, 68), qtype, 64, torch.float32)
    with pytest.raises(ValueError, match="head_dim is 48"):
        kv_quant.check_head_dim("q4_0", 48)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "bf16"])
def test_paged_attention_reads_the_stored_cache(name):
    """A decode step and a continued prefill over a cache stored as `name` give what the same
    paths give over an fp32 cache holding the stored values."""
    gen = torch.Generator().manual_seed(1)
    nb, bs, hkv, hq, d = 6, 4, 2, 4, 32
    stored = torch.zeros(2, nb, bs, hkv, kv_quant.last_dim(name, d), dtype=kv_quant.storage_dtype(name, torch.float32))
    tables = [[3, 1, 4], [5, 2]]
    ctx = AttentionMetadata.build([9, 6], [9, 6], tables, bs)          # a prefill writes the contexts
    k0, v0 = (torch.randn(15, hkv, d, generator=gen) for _ in range(2))
    write_kv(stored, ctx.slot_mapping, k0, v0)
    for q_lens, s_lens in (([1, 1], [10, 7]), ([3, 2], [12, 8])):      # decode, then a continued prefill
        meta = AttentionMetadata.build(q_lens, s_lens, tables, bs)
        t = sum(q_lens)
        q = torch.randn(t, hq, d, generator=gen)
        k, v = (torch.randn(t, hkv, d, generator=gen) for _ in range(2))
        out = paged_attention(meta, stored, q, k, v, 0.2)
        qtype = kv_quant.format_of(stored, d)
        dense = stored.float() if qtype is None else kv_quant.dequantize_rows(stored, qtype, d, torch.float32)
        ref = paged_attention(meta, dense.contiguous(), q, k, v, 0.2, kv_written=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert not torch.equal(dense[0], torch.zeros_like(dense[0]))


def test_flag_validation():
    assert CacheConfig(kv_cache_dtype="Q8_0").kv_cache_dtype == "q8_0"
    assert CacheConfig(kv_cache_dtype="bfloat16").kv_cache_dtype == "bf16"
    with pytest.raises(ValueError, match="no fp8 KV cache.*use q8_0"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="no fp8 KV cache"):
        CacheConfig(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="one of auto, bf16, q8_0, q4_0, got 'q5_1'"):
        CacheConfig(kv_cache_dtype="q5_1")


def test_bytes_per_block_against_bf16():
    stage = StageInfo(rank=0, size=1, start=0, end=4, num_layers=4)
    per = {name: kv_bytes_per_block(stage, 8, 128, 16, torch.bfloat16, name) for name in ("bf16", "q8_0", "q4_0")}
    dense_layer = 2 * 16 * 8 * 128 * 2                # the one layer attention reads a stored one through
    assert per["bf16"] == dense_layer * 4
    assert per["q8_0"] == dense_layer * 4 * 34 // 64 + dense_layer and 34 / 64 <= 0.55
    assert per["q4_0"] == dense_layer * 4 * 18 // 64 + dense_layer and 18 / 64 <= 0.3
    assert kv_bytes_per_block(stage, 8, 128, 16, torch.float32, "auto") == 2 * per["bf16"]
    assert kv_bytes_per_block(stage, 8, 128, 16, torch.float32, "bf16") == per["bf16"] + 2 * dense_layer
