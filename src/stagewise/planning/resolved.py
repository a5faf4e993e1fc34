"""`Resolved`: what start-up works out from the user's `EngineConfig` and the model's facts (the
layer partition, this node's memory budget) and, where stages start, which of them a node runs and
the pipeline's token. The user's config stays what was asked for; start-up returns this record
(`resolve_startup`), the driver reads its facts from here, and `launch_config` is the one place
they join the options a stage process is started with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoint.facts import ModelFacts
from ..config import EngineConfig
from .report import node_budget
from .stage_cost import resolved_partition


@dataclass(frozen=True)
class Resolved:
    """`partition`: layers per stage as counts (None with one stage: it runs every layer, and its
    config keeps the user's choice); `node_memory_bytes`: what this node's stages may use
    (measured once on CPU); `local_stages`: the stages this node runs; `cluster_token`: the secret a
    one-node pipeline made for itself. None: not worked out here (the config's value stands)."""
    partition: tuple[int, ...] | None = None
    node_memory_bytes: int | None = None
    local_stages: tuple[int, ...] | None = None
    cluster_token: str | None = field(default=None, repr=False)    # NOTE: a secret never shows in a log line

    def launch_config(self, config: EngineConfig) -> EngineConfig:
        """The config stage processes are started with: the user's options plus these facts (the one
        record that crosses the process boundary carries both; `config` itself is left as it was)."""
        facts = {"pp_layer_partition": self.partition,
                 "node_memory_bytes": self.node_memory_bytes, "local_stages": self.local_stages,
                 "cluster_token": self.cluster_token}
        return config.replace(**{k: v for k, v in facts.items() if v is not None})


def resolve_startup(config: EngineConfig, facts: ModelFacts) -> Resolved:
    """The partition (a bad one is a clear error here, before any stage starts; how it was chosen is
    logged) and the node's memory budget (a model this node cannot hold is refused, one sentence)."""
    partition = resolved_partition(config, facts)
    return Resolved(partition if config.parallel.pp_size > 1 else None, node_budget(config, facts, partition))
