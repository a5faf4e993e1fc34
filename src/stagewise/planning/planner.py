"""Partitions by memory and speed: which contiguous layers each stage runs and which node runs it,
so that every stage fits its node's memory and the slowest stage (cost / speed) is as fast as
possible. Pure arithmetic over what the caller measured (planning/cluster.py builds the inputs
from a model and the nodes' reports); an exact dynamic programme over (layer, node, stage) states.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

log = logging.getLogger("stagewise.partition")
MAX_EXTRA_PER_NODE_BYTES = 1 << 50      # the search bound for "how much is missing"
_INF = (float("inf"), float("inf"))


@dataclass(frozen=True)
class ModelNeeds:
    """What a stage of the model costs and holds. Per layer: cost (any unit) and bytes as held
    (weights and the KV floor of that layer); the first stage adds the embedding, the last the final
    norm and head; every stage process adds `stage_fixed_bytes` (runtime, activations, graphs)."""
    layer_costs: tuple[float, ...]
    layer_bytes: tuple[int, ...]
    first_cost: float = 0.0
    last_cost: float = 0.0
    first_bytes: int = 0
    last_bytes: int = 0
    stage_fixed_bytes: int = 0
    single_bytes: int | None = None     # one stage holding everything (a tied head counted once)

    @property
    def num_layers(self) -> int:
        return len(self.layer_costs)

    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.first_bytes + self.last_bytes


@dataclass(frozen=True)
class Node:
    """A node as it reported itself: bytes the engine may use there and its relative speed."""
    budget_bytes: int
    speed: float = 1.0
    name: str = ""


@dataclass(frozen=True)
class ClusterPlan:
    partition: tuple[int, ...]          # layers per stage
    layout: tuple[int, ...]             # the node (index into the node list) of each stage
    stage_times: tuple[float, ...]      # cost / speed per stage
    stage_bytes: tuple[int, ...]        # what each stage holds (layers, extras, fixed bytes)
    stage_budget_bytes: tuple[int, ...]  # each stage's share of its node's budget
    left_out: tuple[int, ...]           # nodes with no stage

    @property
    def shares(self) -> tuple[float, ...]:
        total = sum(self.stage_times) or 1.0
        return tuple(t / total for t in self.stage_times)


class _Search:
    """The dynamic programme; `counts[j]`: the stage counts node j may take (0 = left out)."""

    def __init__(self, needs: ModelNeeds, nodes: list[Node], counts: list[tuple[int, ...]],
                 num_stages: int | None, extra_bytes: int = 0, ends: frozenset[int] | None = None):
        self.needs, self.nodes, self.counts, self.num_stages = needs, nodes, counts, num_stages
        self.extra_bytes, self.ends = extra_bytes, ends
        self.cost_prefix, self.bytes_prefix = [0.0], [0]
        for c, b in zip(needs.layer_costs, needs.layer_bytes):
            self.cost_prefix.append(self.cost_prefix[-1] + c)
            self.bytes_prefix.append(self.bytes_prefix[-1] + b)
        self.best = functools.lru_cache(maxsize=None)(self._best)

    def stage_bytes(self, a: int, c: int) -> int:
        n = self.needs
        if a == 0 and c == n.num_layers and n.single_bytes is not None:
            return n.single_bytes + n.stage_fixed_bytes
        held = self.bytes_prefix[c] - self.bytes_prefix[a] + n.stage_fixed_bytes
        return held + (n.first_bytes if a == 0 else 0) + (n.last_bytes if c == n.num_layers else 0)

    def stage_cost(self, a: int, c: int) -> float:
        n = self.needs
        return (self.cost_prefix[c] - self.cost_prefix[a] + (n.first_cost if a == 0 else 0.0)
                + (n.last_cost if c == n.num_layers else 0.0))

    def budget(self, node: int, count: int) -> int:
        return (self.nodes[node].budget_bytes + self.extra_bytes) // count

    def time(self, node: int, count: int, a: int, c: int) -> float:
        """A node's stages share its cores, so each runs at speed / count."""
        return self.stage_cost(a, c) * count / self.nodes[node].speed

    def _best(self, b: int, node: int, count: int, used: int, stages: int) -> tuple:
        """(slowest time, sum of squared times, stages as (node, count, start, end)) covering layers
        [b, L) from node `node` on, which holds `count` stages of which `used` are placed."""
        best: tuple = (*_INF, ())
        if used < count:
            for c in range(b + 1, self.needs.num_layers + 1):
                if self.stage_bytes(b, c) > self.budget(node, count):
                    break                       # bytes only grow with c
                if self.ends is not None and c not in self.ends:
                    continue
                sub = self.best(c, node, count, used + 1, stages + 1)
                t = self.time(node, count, b, c)
                cand = (max(t, sub[0]), t * t + sub[1], ((node, count, b, c), *sub[2]))
                best = min(best, cand, key=lambda x: x[:2])
            return best
        if b == self.needs.num_layers:
            return (0.0, 0.0, ()) if self.num_stages in (None, stages) else best
        for nxt in range(node + 1, len(self.nodes)):
            for k in self.counts[nxt]:
                if k and (self.num_stages is None or stages + k <= self.num_stages):
                    best = min(best, self.best(b, nxt, k, 0, stages), key=lambda x: x[:2])
        return best

    def run(self) -> tuple:
        return self.best(0, -1, 0, 0, 0)


def plan_partition(needs: ModelNeeds, nodes: list[Node], num_stages: int | None = None,
                   stages_per_node: list[int] | None = None, partition: tuple[int, ...] | None = None
                   ) -> ClusterPlan:
    """The fastest plan in which every stage fits its node: `stages_per_node` fixes each node's stage
    count (0: none); else `num_stages` stages over the nodes, several per node where needed; else one
    stage per useful node. A given `partition` (layers per stage) is kept: only the nodes are chosen.
    Nodes keep their order along the ring (node 0 first: it hosts the driver). Raises ValueError,
    saying how much memory is missing, when no plan fits."""
    ends = None
    if partition is not None:
        num_stages, ends = len(partition), frozenset(sum(partition[:i + 1]) for i in range(len(partition)))
    counts = _counts(len(nodes), num_stages, stages_per_node)
    search = _Search(needs, nodes, counts, num_stages, ends=ends)
    found = search.run()
    if found[0] == float("inf"):
        raise ValueError(_missing_text(needs, nodes, counts, num_stages, ends))
    return _plan_of(search, found[2], len(nodes))


def _counts(num_nodes: int, num_stages: int | None, stages_per_node: list[int] | None) -> list[tuple[int, ...]]:
    if stages_per_node is not None:
        if len(stages_per_node) != num_nodes or any(k < 0 for k in stages_per_node):
            raise ValueError(f"stages_per_node {stages_per_node} needs {num_nodes} counts of 0 or more.")
        return [(k,) for k in stages_per_node]
    if num_stages is None:
        return [(0, 1)] * num_nodes
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}.")
    return [tuple(range(num_stages + 1))] * num_nodes


def _plan_of(search: _Search, stages: tuple, num_nodes: int) -> ClusterPlan:
    layout = tuple(node for node, _, _, _ in stages)
    return ClusterPlan(partition=tuple(c - a for _, _, a, c in stages), layout=layout,
                       stage_times=tuple(search.time(n, k, a, c) for n, k, a, c in stages),
                       stage_bytes=tuple(search.stage_bytes(a, c) for _, _, a, c in stages),
                       stage_budget_bytes=tuple(search.budget(n, k) for n, k, _, _ in stages),
                       left_out=tuple(n for n in range(num_nodes) if n not in layout))


def _missing_text(needs: ModelNeeds, nodes: list[Node], counts: list, num_stages: int | None,
                  ends: frozenset[int] | None) -> str:
    """One sentence: the smallest memory added to every node that makes a plan fit, times the nodes."""
    def fits(extra: int) -> bool:
        return _Search(needs, nodes, counts, num_stages, extra, ends).run()[0] != float("inf")
    low, high = 0, 1 << 20
    while not fits(high):
        low, high = high, high * 2
        if high > MAX_EXTRA_PER_NODE_BYTES:
            return "No plan fits these nodes at any memory size (more stages than layers?)."
    while high - low > (1 << 20):
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    have = sum(n.budget_bytes for n in nodes)
    return (f"The nodes together cannot hold the model: they have {_gib(have)} for it, about "
            f"{_gib(high * len(nodes))} is missing ({_gib(high)} more on each of the {len(nodes)} node(s)).")


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def useful_nodes(needs: ModelNeeds, nodes: list[Node]) -> list[int]:
    """Nodes whose budget holds the smallest stage: one layer (the lightest) and the fixed bytes."""
    smallest = min(needs.layer_bytes, default=0) + needs.stage_fixed_bytes
    return [j for j, n in enumerate(nodes) if n.budget_bytes >= smallest]
