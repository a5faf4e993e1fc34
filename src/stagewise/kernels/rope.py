"""Rope kernel (csrc/rope.c): bindings, argument checks and the op `stagewise::rope_kv`.

`rope_kv(qkv, cos, sin, heads, kv_heads, kv_cache, slots)` -> `(q, k)`: the rows
`[T, (Hq + 2 Hkv) D]` of a fused qkv projection (float32 or bfloat16, unit column stride), their
q and k heads roped into `q` `[T, Hq, D]` and `k` `[T, Hkv, D]` as model/layers.py
`apply_rotary_full` computes them,
`x * cos + [x2, x1] * sin` with cos / sin `[T, D]` (or `[T, 1, D]`: `RotaryEmbedding.tables`),
each op rounded as PyTorch rounds it (PyTorch's eager bits, float32 and bfloat16). With a KV
cache `[2, num_blocks, block_size, Hkv, D]` and `slots` `[n]` (n <= T), the first n rows' roped
k and their v heads are written at those flat slots, as attention.py `write_kv` does: one call
per layer instead of a cat, three elementwise ops and two index_copy_.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import build, native, team
from .registry import define

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _load() -> ctypes.CDLL | None:
    lib = build.library("rope", ["rope.c"])
    if lib is None:
        return None
    bind(lib)
    team.hand_to(lib, "rope")      # many rows split over the stage's kernel team
    native.load("rope", lib)
    return lib


def bind(lib: ctypes.CDLL) -> None:
    """Argument types of the entry points (tests bind their narrower builds with it too)."""
    i64, p = ctypes.c_int64, ctypes.c_void_p
    for name in ("rope_kv_f32", "rope_kv_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, p, i64, p, p, i64, i64, i64, i64, p, i64, p, i64]
        fn.restype = i64


def available() -> bool:
    return _load() is not None


def supports(qkv: torch.Tensor, cos: torch.Tensor, heads: int, kv_heads: int) -> bool:
    """What the kernel serves, from static properties: CPU float32/bfloat16 rows `[T, (Hq + 2 Hkv) D]`
    with unit column stride, an even head size D and tables of the same dtype, `[T, D]` or
    `[T, 1, D]`, rows of unit column stride."""
    if not (qkv.device.type == "cpu" and qkv.dtype in _DTYPES and qkv.dim() == 2 and qkv.stride(1) == 1
            and cos.dtype == qkv.dtype and cos.device.type == "cpu" and heads > 0 and kv_heads > 0):
        return False
    d = cos.shape[-1]
    return (d > 0 and d % 2 == 0 and qkv.shape[1] == (heads + 2 * kv_heads) * d and cos.stride(-1) == 1
            and cos.dim() in (2, 3) and cos.shape[0] == qkv.shape[0] and (cos.dim() == 2 or cos.shape[1] == 1))


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    return f"{t.dtype} {t.device.type} {list(t.shape)} strides {list(t.stride())}"


def _check(qkv, cos, sin, heads, kv_heads, kv_cache, slots) -> None:
    ok = (supports(qkv, cos, heads, kv_heads) and sin.dtype == cos.dtype and sin.device.type == "cpu"
          and sin.shape == cos.shape and sin.stride() == cos.stride())
    if ok and (kv_cache is not None or slots is not None):
        d = cos.shape[-1]
        ok = (kv_cache is not None and slots is not None and kv_cache.device.type == "cpu"
              and kv_cache.dtype == qkv.dtype and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
              and kv_cache.shape[3] == kv_heads and kv_cache.shape[4] == d and kv_cache.is_contiguous()
              and slots.device.type == "cpu" and slots.dtype == torch.int64 and slots.dim() == 1
              and slots.is_contiguous() and slots.numel() <= qkv.shape[0])
    if not ok:
        raise ValueError(f"stagewise rope_kv: qkv {_describe(qkv)}, cos {_describe(cos)}, sin {_describe(sin)}, "
                         f"heads {heads}, kv_heads {kv_heads}, kv_cache {_describe(kv_cache)}, slots "
                         f"{_describe(slots)}; it needs CPU float32 or bfloat16 of one dtype: qkv [T, (heads + 2 "
                         "kv_heads) D] with unit column stride, cos and sin alike [T, D] or [T, 1, D] with D even, "
                         "and a contiguous kv_cache [2, blocks, block_size, kv_heads, D] with int64 slots [n <= T] "
                         "(both or neither).")


def _rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
             kv_cache: torch.Tensor | None, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    _check(qkv, cos, sin, heads, kv_heads, kv_cache, slots)
    lib = _load()
    if lib is None:
        raise RuntimeError("The rope kernel is not available on this machine.")
    rows, d = qkv.shape[0], cos.shape[-1]
    q, k = qkv.new_empty(rows, heads, d), qkv.new_empty(rows, kv_heads, d)
    fn = lib.rope_kv_f32 if qkv.dtype == torch.float32 else lib.rope_kv_bf16
    cache_slots = 0 if kv_cache is None else kv_cache.shape[1] * kv_cache.shape[2]
    bad = fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), q.data_ptr(),
             k.data_ptr(), rows, heads, kv_heads, d, None if kv_cache is None else kv_cache.data_ptr(), cache_slots,
             None if slots is None else slots.data_ptr(), 0 if slots is None else slots.numel())
    if bad >= 0:
        assert slots is not None       # a bad slot needs slots
        raise ValueError(f"stagewise rope_kv: slot {int(slots[bad])} (row {bad}) is outside the KV cache's "
                         f"{cache_slots} slots; nothing was written.")
    return q, k


def _fake(qkv, cos, sin, heads, kv_heads, kv_cache, slots):
    rows, d = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty(rows, heads, d), qkv.new_empty(rows, kv_heads, d)


define("rope_kv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!)? kv_cache, "
       "Tensor? slots) -> (Tensor, Tensor)", _rope_kv, _fake)


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
            kv_cache: torch.Tensor | None = None,
            slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The roped q `[T, Hq, D]` and k `[T, Hkv, D]` heads (and the KV cache written at `slots`): the C++
    op where it is registered (or a dispatch mode records ops), else the Python one called
    directly (no dispatcher)."""
    if native.loaded("rope") or _get_current_dispatch_mode() is not None:
        return torch.ops.stagewise.rope_kv(qkv, cos, sin, heads, kv_heads, kv_cache, slots)
    return _rope_kv(qkv, cos, sin, heads, kv_heads, kv_cache, slots)
