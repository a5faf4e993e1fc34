"""`Resolved`: what an engine's start-up works out from the user's `EngineConfig` and the model's
facts (the layer partition, this node's memory budget). The user's config stays what was asked
for; start-up returns this record (`resolve_startup`), and the driver reads its facts from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.facts import ModelFacts
from ..config import EngineConfig
from .report import node_budget
from .stage_cost import resolved_partition


@dataclass(frozen=True)
class Resolved:
    """`partition`: layers per stage as counts; `node_memory_bytes`: what this node's stages may
    use (measured once, CPU; None elsewhere or where the user gave none and nothing measured)."""
    partition: tuple[int, ...]
    node_memory_bytes: int | None

    def launch_config(self, config: EngineConfig) -> EngineConfig:
        """The config stage processes are started with: the user's options plus these facts (the one
        record that crosses the process boundary carries both; `config` itself is left as it was)."""
        if config.parallel.pp_size == 1:     # one stage: its config keeps the user's choice (it runs all layers)
            return config.replace(node_memory_bytes=self.node_memory_bytes)
        return config.replace(pp_layer_partition=self.partition, node_memory_bytes=self.node_memory_bytes)


def resolve_startup(config: EngineConfig, facts: ModelFacts) -> Resolved:
    """The partition (a bad one is a clear error here, before any stage starts; how it was chosen is
    logged) and the node's memory budget (a model this node cannot hold is refused, one sentence)."""
    partition = resolved_partition(config, facts)
    return Resolved(partition, node_budget(config, facts, partition))
