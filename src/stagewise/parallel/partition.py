"""Layer placement: which global layer ids each pipeline stage owns. N layers over P stages give
N // P each and one more to the last N % P stages; every stage keeps global layer ids."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageInfo:
    """One stage's place in the pipeline; layers are `[start, end)` by global id."""

    rank: int
    size: int
    start: int
    end: int
    num_layers: int  # layers in the whole model

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, layer_id: int) -> bool:
        return self.start <= layer_id < self.end

    @classmethod
    def single(cls, num_layers: int) -> "StageInfo":
        return cls(rank=0, size=1, start=0, end=num_layers, num_layers=num_layers)


def partition_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | list[int] | None = None
                     ) -> list[tuple[int, int]]:
    """Split `num_layers` over `pp_size` stages; the last `N % P` stages get one more layer."""
    if pp_size < 1:
        raise ValueError(f"pp_size must be at least 1, got {pp_size}.")
    if partition is not None:
        sizes = list(partition)
        if len(sizes) != pp_size or any(s <= 0 for s in sizes) or sum(sizes) != num_layers:
            raise ValueError(
                f"pp_layer_partition {','.join(map(str, sizes))} is invalid: it needs exactly {pp_size} positive "
                f"entries (one per stage) summing to the model's {num_layers} layers.")
    else:
        if pp_size > num_layers:
            raise ValueError(f"pp_size {pp_size} exceeds the model's {num_layers} layers; "
                             f"use at most {num_layers} stages.")
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if r >= pp_size - extra else 0) for r in range(pp_size)]
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s
    return ranges


def stage_infos(num_layers: int, pp_size: int, partition=None) -> list[StageInfo]:
    return [StageInfo(rank=r, size=pp_size, start=a, end=b, num_layers=num_layers)
            for r, (a, b) in enumerate(partition_layers(num_layers, pp_size, partition))]
