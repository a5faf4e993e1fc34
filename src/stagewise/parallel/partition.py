"""Layer placement: which global layer ids each pipeline stage owns. The even split gives N // P
layers each and one more to the last N % P stages; `balanced_partition` splits by cost instead (the
cost model itself lives in planning/stage_cost.py). Every stage keeps global layer ids."""
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


def partition_layers(num_layers: int, pp_size: int,
                     partition: tuple[int, ...] | list[int] | str | None = None
                     ) -> list[tuple[int, int]]:
    """Split `num_layers` over `pp_size` stages: `partition` as given (validated), else evenly, the
    last `N % P` stages getting one more layer. `auto` with several stages must be resolved first
    (planning.stage_cost)."""
    if isinstance(partition, str):
        if partition != "even" and pp_size > 1:
            raise ValueError(f"pp_layer_partition {partition!r} must be resolved to layer counts before the "
                             "stages are built (planning.stage_cost.resolve_partition).")
        partition = None
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


def stage_costs(sizes: tuple[int, ...] | list[int], layer_costs: list[float], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """Each stage's cost for a partition `sizes`: its layers, plus the embedding on the first stage
    and the final norm, head and sampling on the last."""
    costs, start = [], 0
    for s in sizes:
        costs.append(sum(layer_costs[start:start + s]))
        start += s
    costs[0] += first_extra
    costs[-1] += last_extra
    return costs


def balanced_partition(layer_costs: list[float], pp_size: int, first_extra: float = 0.0, last_extra: float = 0.0,
                       rates: list[float] | None = None) -> tuple[int, ...]:
    """Contiguous layer counts (each >= 1) minimising the slowest stage's time, cost / rate (`rates`:
    each stage's relative speed, default all 1); ties go to the flatter split (sum of squared times).
    Exact dynamic programme over (stages, layers): O(P * N^2)."""
    n = len(layer_costs)
    if not 1 <= pp_size <= n:
        raise ValueError(f"pp_size {pp_size} needs between 1 and {n} stages for the model's {n} layers.")
    rates = list(rates) if rates is not None else [1.0] * pp_size
    if len(rates) != pp_size or any(not r > 0 for r in rates):
        raise ValueError(f"stage rates {rates} need {pp_size} positive entries, one per stage.")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> float:      # stage s holding layers [a, b)
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == pp_size - 1 else 0.0)
        return (prefix[b] - prefix[a] + extra) / rates[s]

    inf = (float("inf"), float("inf"))
    # best[s][b]: (max time, sum of squares) of stages 0..s covering layers [0, b); cut[s][b]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(pp_size)]
    cut = [[0] * (n + 1) for _ in range(pp_size)]
    for b in range(1, n + 1):
        t = cost(0, 0, b)
        best[0][b] = (t, t * t)
    for s in range(1, pp_size):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                prev = best[s - 1][a]
                t = cost(s, a, b)
                cand = (max(prev[0], t), prev[1] + t * t)
                if cand < best[s][b]:
                    best[s][b], cut[s][b] = cand, a
    sizes, b = [], n
    for s in range(pp_size - 1, 0, -1):
        a = cut[s][b]
        sizes.append(b - a)
        b = a
    sizes.append(b)
    return tuple(reversed(sizes))
