"""The collectives of one stage's tensor-parallel ranks, all on one node: the shared-memory group
(kernels/comm.py) where its kernel built, else gloo over loopback. Both are opened from one private
directory the ranks share (the group file, or gloo's file store); `open_group` picks, and every
rank of a stage picks alike (they run the same build on the same machine).
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from ..kernels import comm

SLOT_BYTES = 4 << 20        # per rank and buffer: a [rows, vocab / tp] logits row fits in one slot


class GlooGroup:
    """Sum and gather over a gloo process group of its own (no global torch.distributed state)."""

    def __init__(self, store_path: str, rank: int, size: int, timeout_s: float):
        import torch.distributed as dist
        store = dist.FileStore(store_path, size)
        options = dist.ProcessGroupGloo._Options()              # type: ignore[attr-defined]  # not in the stubs
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: Any = dist.ProcessGroupGloo(store, rank, size, options)
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        _wait(self.pg.allreduce([out]), "all-reduce")
        return out

    def all_gather(self, x: torch.Tensor, dst: int = -1) -> torch.Tensor:
        """`[R, C]` per rank -> `[R, size * C]`, rank r's columns at `r * C` (every rank gets them)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _wait(self.pg.allgather([parts], [x.contiguous()]), "all-gather")
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        pass


def _wait(work, op: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:      # a peer died or timed out: the group is unusable
        raise comm.CollectiveError(f"tensor-parallel {op} over gloo failed: {str(exc).splitlines()[0]}") from None


def prepare(directory: str, size: int) -> None:
    """Rank 0, before the other ranks open the group: make the shared-memory group file (gloo needs
    nothing made ahead)."""
    if comm.available():
        comm.create(os.path.join(directory, "group"), size, SLOT_BYTES)


def open_group(directory: str, rank: int, size: int, timeout_s: float) -> comm.ShmGroup | GlooGroup:
    """This rank's group in `directory` (made by rank 0's `prepare`); `timeout_s` bounds each wait."""
    if comm.available():
        return comm.ShmGroup(os.path.join(directory, "group"), rank, size, timeout_s)
    return GlooGroup(os.path.join(directory, "gloo-store"), rank, size, timeout_s)
