"""What each node tells the driver when it joins: the memory it may use (MemAvailable and its
cgroup's room) and a short measured speed, under one key per node in the driver's store. The
driver reads them before it chooses a partition and a layout (recovery/placement.py)."""
from __future__ import annotations

import logging

from ..planning.cluster import NodeReport
from .rendezvous import Store

log = logging.getLogger("stagewise.executor")
REPORT_KEY = "stagewise/report/node{node}"


def publish_report(store: Store, node: int, report: NodeReport | None = None) -> NodeReport:
    """Measure this node (before it loads anything) and publish the report; returns it."""
    report = report or NodeReport.measure()
    store.set(REPORT_KEY.format(node=node), report.to_json())
    log.info("node %d reports %s available, speed %.1f GMAC/s", node,
             "unknown memory" if report.available_bytes is None else f"{report.available_bytes / (1 << 30):.2f} GiB",
             report.speed)
    return report


def read_reports(store: Store, nodes: list[int]) -> dict[int, NodeReport]:
    """The reports of `nodes` that have published one (the latest: a node that rejoins reports again)."""
    keys = {n: REPORT_KEY.format(node=n) for n in nodes}
    return {n: NodeReport.from_json(store.get(k)) for n, k in keys.items() if store.check([k])}
