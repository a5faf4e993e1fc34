"""The driver's engine options travel to every node: with each pipeline it builds, the driver
publishes its options (`shipped_options`), and a node runs its stages of that pipeline with them
(`adopt_options`) instead of its own command line's. Nodes started with other flags (one with
`--prefill-graph breakable`, one without) then still run one policy, one block size, one budget.
What is a node's own stays its own (`NODE_OWN`): where its files are, its rank and memory, its
threads and spare processes, its network interface and its secret.
"""
from __future__ import annotations

import dataclasses
import json
import logging

from ..config import EngineConfig

log = logging.getLogger("stagewise.executor")
# options that describe the node itself, not the engine: never taken from the driver (its spare
# processes are its own memory and CPU too)
NODE_OWN = frozenset({"model", "tokenizer", "device", "node_rank", "local_stages", "node_memory_bytes",
                      "cluster_token", "dist_ifname", "threads_per_stage", "kv_cache_dir", "master_addr",
                      "master_port", "pipeline_spares", "pipeline_spares_delay_s"})
# shipped, but a difference is not worth a line: the driver resolves `auto` into counts, and the node
# logs the layers it runs
QUIET = frozenset({"pp_layer_partition"})


def shipped_options(config: EngineConfig) -> str:
    """The driver's engine options as JSON (those a node takes: all but NODE_OWN)."""
    options = {k: _plain(v) for k, v in config.options().items() if k not in NODE_OWN}
    return json.dumps(options, sort_keys=True)


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return list(value) if isinstance(value, tuple) else value


def adopt_options(config: EngineConfig, shipped: str | None, told: set[str] | None = None) -> EngineConfig:
    """This node's config with the driver's engine options (`shipped`, None: a driver that sends
    none keeps the node's own). A flag of this node's command line that differs is logged once
    (`told` remembers which were)."""
    if shipped is None:
        return config
    options = {k: v for k, v in json.loads(shipped).items() if k not in NODE_OWN}
    try:
        adopted = config.replace(**options)
    except ValueError as exc:
        raise ValueError(f"Node {config.cluster.node_rank} cannot run the driver's engine options ({exc}); run the "
                         f"same stagewise version on every node.") from None
    mine, theirs = config.options(), adopted.options()
    differ = sorted(k for k in options if k not in QUIET and mine[k] != theirs[k] and (told is None or k not in told))
    if differ:
        shown = "; ".join(f"--{k.replace('_', '-')} {_shown(theirs[k])} (here: {_shown(mine[k])})" for k in differ)
        log.warning("node %d runs its stages with the driver's engine options; its own command line differs in %s",
                    config.cluster.node_rank, shown)
        if told is not None:
            told.update(differ)
    return adopted


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return "unset" if value is None else str(value)
