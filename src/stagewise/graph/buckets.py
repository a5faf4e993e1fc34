"""Bucket ladders: which token counts (prefill) and batch sizes (decode) get a captured graph.

Plain Python, no torch: the driver picks buckets every step and must stay cheap to import.
"""
from __future__ import annotations

from bisect import bisect_left

# (first, last, step) rungs of the prefill ladder: fine steps where prompts are short, coarser
# above; past the last rung the step is 512.
_PREFILL_RUNGS = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))
_TAIL_STEP = 512


def prefill_bucket_ladder(cap: int) -> list[int]:
    """Token-count buckets `<= cap`, plus `cap` itself (cap 8192 -> 58 entries, 4096 -> 50)."""
    if cap < 1:
        raise ValueError(f"The prefill graph capture cap must be a positive token count, got {cap}.")
    sizes = [s for first, last, step in _PREFILL_RUNGS for s in range(first, last + 1, step) if s <= cap]
    size = _PREFILL_RUNGS[-1][1] + _TAIL_STEP
    while size <= cap:
        sizes.append(size)
        size += _TAIL_STEP
    if not sizes or sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def decode_bucket_ladder(max_bs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every 8 up to `max_bs`, plus `max_bs` itself."""
    if max_bs < 1:
        raise ValueError(f"The decode graph batch-size cap must be at least 1, got {max_bs}.")
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def pick_bucket(buckets: list[int] | tuple[int, ...], n: int) -> int | None:
    """The smallest bucket `>= n` (buckets sorted ascending), or None when `n` exceeds them all."""
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None
