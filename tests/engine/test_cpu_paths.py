"""The CPU fast paths against the plain computations they replace: the sampler's finite check and
argmax, the in-order decode attention, one-row GEMV kernels, dtype `auto` and stage threads."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from stagewise.config import EngineConfig
from stagewise.model.attention import AttentionMetadata, sdpa_paged_attention
from stagewise.runtime.sampler import row_argmax, rows_finite
from stagewise.runtime.setup import intra_op_threads


def test_row_argmax_is_torch_argmax_including_ties():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=gen)
    x[1, 700] = x[1, 3000] = 50.0               # tie across blocks: the first index wins
    x[2, 258] = x[2, 259] = 50.0                # tie inside one block
    x[3] = 1.0                                  # a constant row
    x[4, 4095] = 99.0                           # the very last column
    assert torch.equal(row_argmax(x), x.argmax(-1))
    odd = torch.randn(3, 1000, generator=gen)  # vocab not a multiple of the block: torch's argmax
    assert torch.equal(row_argmax(odd), odd.argmax(-1))


def test_rows_finite_is_isfinite_all():
    x = torch.randn(5, 2048)
    x[1, 7], x[2, 9], x[3, 11] = float("nan"), float("inf"), float("-inf")
    assert torch.equal(rows_finite(x), torch.isfinite(x).all(-1))


def test_in_order_decode_attention_equals_the_general_path():
    """An all-decode step takes the gather-free path; one padding row forces the general path."""
    torch.manual_seed(0)
    bs, hkv, hq, d = 4, 2, 6, 8
    cache = torch.randn(2, 40, bs, hkv, d)
    seq_lens = [5, 13, 9]                        # different block counts: the batch order must hold
    tables = [[1, 2], [3, 4, 5, 6], [7, 8, 9]]
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, tables, bs)
    assert meta.is_plain_decode
    q, k, v = torch.randn(4, hq, d), torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    fast = sdpa_paged_attention(meta, cache.clone(), q[:3], k[:3], v[:3], 0.3)
    general = sdpa_paged_attention(meta, cache.clone(), q, k, v, 0.3)      # rows 4 > T 3
    torch.testing.assert_close(fast, general[:3], rtol=0, atol=1e-6)
    assert not AttentionMetadata.build([1, 4], [5, 4], tables[:2], bs).is_plain_decode


def test_dtype_auto_keeps_small_models_in_float32(llama_dir):
    from stagewise.checkpoint.facts import read_facts
    from stagewise.model.loader import resolve_dtype
    config = read_facts(llama_dir).hf
    assert resolve_dtype("auto", config, "cpu") == torch.float32            # hidden 64
    config.hidden_size = 256
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    native = "amx_bf16" in flags or "avx512_bf16" in flags
    assert resolve_dtype("auto", config, "cpu") == (torch.bfloat16 if native else torch.float32)


def test_threads_per_stage_default():
    assert intra_op_threads(EngineConfig.from_kwargs(model="x")) is None                # PP=1: the caller's setting
    assert intra_op_threads(EngineConfig.from_kwargs(model="x", threads_per_stage=3)) == 3
    cores = len(os.sched_getaffinity(0))
    assert intra_op_threads(EngineConfig.from_kwargs(model="x", pp_size=2)) == max(1, cores // 2)


def test_one_row_bf16_steps_use_native_gemv_and_restore_onednn():
    from stagewise.runtime.kernels import gemm_kernels
    cpu = torch.device("cpu")
    assert torch.backends.mkldnn.enabled
    with gemm_kernels(1, torch.bfloat16, cpu):
        assert not torch.backends.mkldnn.enabled
    assert torch.backends.mkldnn.enabled
    for rows, dtype in ((2, torch.bfloat16), (1, torch.float32)):
        with gemm_kernels(rows, dtype, cpu):
            assert torch.backends.mkldnn.enabled
