"""KV cache storage formats: `auto`/`bf16` (dense) and llama.cpp's `q8_0`/`q4_0` (quantized).

A quantized cache row `[..., D]` is stored as ggml's own blocks of 32 values along the head
dimension (an fp16 scale, then 32 int8 codes or 16 bytes of 4-bit codes), so a row is
`D / 32 * 34` (q8_0) or `D / 32 * 18` (q4_0) uint8 bytes. The bit layout and rounding are
`quant_formats`' (gguf-py's, the test oracle); this module only maps cache rows onto it.
"""
from __future__ import annotations

import mmap
import sys

import torch

from ..checkpoint.gguf_meta import GGMLType
from . import quant_formats as qf

QUANTIZED = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
BLOCK = 32


def check_head_dim(name: str, head_dim: int) -> None:
    """A quantized cache needs whole blocks of 32 along the head dimension."""
    if name in QUANTIZED and head_dim % BLOCK:
        raise ValueError(f"kv_cache_dtype {name} stores blocks of {BLOCK} values along the head dimension, but this "
                         f"model's head_dim is {head_dim}; use --kv-cache-dtype auto or bf16.")


def storage_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype: the model's for auto, bfloat16 for bf16, uint8 bytes when quantized."""
    if name in QUANTIZED:
        return torch.uint8
    return torch.bfloat16 if name == "bf16" else compute


def row_bytes(name: str, head_dim: int, compute: torch.dtype) -> int:
    """Bytes one head's K (or V) row of `head_dim` values takes in the cache (scales included)."""
    check_head_dim(name, head_dim)
    if name in QUANTIZED:
        return qf.row_bytes(QUANTIZED[name], head_dim)
    return head_dim * storage_dtype(name, compute).itemsize


def last_dim(name: str, head_dim: int) -> int:
    """The cache tensor's last dimension: `head_dim`, or the bytes of a quantized row."""
    check_head_dim(name, head_dim)
    return qf.row_bytes(QUANTIZED[name], head_dim) if name in QUANTIZED else head_dim


def format_of(cache: torch.Tensor, head_dim: int) -> GGMLType | None:
    """The quantized format a uint8 cache holds (told apart by its row bytes), None for a dense one."""
    if cache.dtype != torch.uint8:
        return None
    for qtype in QUANTIZED.values():
        if cache.shape[-1] == qf.row_bytes(qtype, head_dim):
            return qtype
    raise ValueError(f"A uint8 KV cache with rows of {cache.shape[-1]} bytes is no q8_0/q4_0 layout for "
                     f"head_dim {head_dim}.")


def quantize_rows(x: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """Float `[..., D]` -> uint8 `[..., row_bytes]` in ggml's block layout (as gguf-py quantizes)."""
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"quantize_rows: the last dimension ({d}) is not a multiple of {BLOCK}.")
    flat = x.reshape(-1, d)
    return qf.encode(qf.quantize(flat, qtype)).reshape(*x.shape[:-1], -1)


def dequantize_rows(raw: torch.Tensor, qtype: GGMLType, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 `[..., row_bytes]` -> `[..., head_dim]` of `dtype` (gguf-py's float32 values, then cast)."""
    if raw.dtype != torch.uint8 or raw.shape[-1] != qf.row_bytes(qtype, head_dim):
        raise ValueError(f"dequantize_rows: expected uint8 rows of {qf.row_bytes(qtype, head_dim)} bytes, got "
                         f"{raw.dtype} rows of {raw.shape[-1]}.")
    # NOTE: the blocks' two fields read directly (not through quant_formats' general decode): this
    # runs on every step's blocks; the products are gguf-py's (fp16 scale to fp32, times the code)
    size = 34 if qtype == GGMLType.Q8_0 else 18
    blocks = raw.reshape(-1, size)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()              # [N, 1]
    if qtype == GGMLType.Q8_0:
        codes = blocks[:, 2:].view(torch.int8).float()                          # [N, 32]
    else:
        packed = blocks[:, 2:]
        codes = torch.cat([packed & 15, packed >> 4], -1).to(torch.int8).sub_(8).float()
    return (codes * scale).to(dtype).reshape(*raw.shape[:-1], head_dim)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on Linux CPUs backed by anonymous pages that become resident only when written."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)   # keeps `pages` alive
