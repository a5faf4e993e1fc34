"""Where each rank runs. World = pp_size + 1 ranks: rank 0 is the driver (it owns the scheduler),
rank s+1 runs stage s. Messages travel a ring: driver → stage 0 → … → last stage → driver. Node n
of `nnodes` hosts stages [n*k, (n+1)*k) for k = pp_size / nnodes; node 0 also hosts the driver.
"""
from __future__ import annotations

DRIVER_RANK = 0


def stage_rank(stage: int) -> int:
    return stage + 1


def ring_next(rank: int, world_size: int) -> int:
    return (rank + 1) % world_size


def ring_prev(rank: int, world_size: int) -> int:
    return (rank - 1) % world_size


def default_layout(pp_size: int, nnodes: int) -> tuple[int, ...]:
    """The node of each stage as the command line gives it: k = pp_size / nnodes consecutive stages each."""
    k = max(1, pp_size // nnodes)          # fewer stages than nodes (elastic, --min-nodes): one each
    return tuple(min(s // k, nnodes - 1) for s in range(pp_size))


def stages_of(layout: tuple[int, ...], node_rank: int) -> list[int]:
    return [s for s, node in enumerate(layout) if node == node_rank]
