"""A pipeline across nodes survives its failures: the driver numbers each pipeline it builds (a
generation) in one store it serves on --master-port for its whole life, and the other nodes'
`run_headless` follows the numbers. For each new generation a node stops its old stages, says it
is ready, and starts the stages the driver's layout for that generation gives it (the node of
each stage; none when the driver gave up waiting for this node: it joins the next generation),
with that generation's layer partition (the driver re-partitions when nodes come and go). Each
node beats a counter in the store, so a rebuild waits only for nodes that are alive; a node sent
SIGTERM asks to leave and exits once the driver has built a pipeline without it.
"""
from __future__ import annotations

import json
import logging
import signal
import threading
import time

from ..cluster.auth import cluster_token, key_of, warn_if_open
from ..cluster.layout import stages_of
from ..cluster.netif import master_ip
from ..cluster.node_options import adopt_options
from ..cluster.node_reports import publish_report
from ..cluster.rendezvous import Store, join_store, serve_store
from ..cluster.store import StoreServer
from ..planning.cluster import NodeReport
from ..planning.memory import measured_node_bytes
from ..planning.resolved import Resolved
from .hygiene import kill_local_stages
from .spawn import prepare_stage_env, spawn_stages, start_warm, wait_warm

log = logging.getLogger("stagewise.executor")
GENERATION_KEY = "stagewise/generation"     # in the driver's store: the number of its current pipeline
STOPPED_KEY = "stagewise/stopped"           # set once the driver builds no more pipelines
READY_KEY = "stagewise/g{generation}/node{node}"      # a node is ready to join that generation
LAYOUT_KEY = "stagewise/g{generation}/layout"         # that generation's node of each stage (JSON)
PARTITION_KEY = "stagewise/g{generation}/partition"   # that generation's layers per stage (JSON)
OPTIONS_KEY = "stagewise/g{generation}/options"       # the driver's engine options (JSON, node_options.py)
ALIVE_KEY = "stagewise/alive/node{node}"              # a counter each node's headless loop advances
LEAVING_KEY = "stagewise/leaving/node{node}"          # "1": the node asked to leave; "0": it serves
ALIVE_EVERY_S = 0.25
# A node whose counter stood still this long is taken for gone (6 beats: a node throttled by its CPU
# quota or a loaded machine still beats within it); a rebuild after a node is lost waits about this.
SILENT_S = 1.5
# A rebuilt pipeline's stages recompute the live requests first: a warm process that had to be
# started again (seconds of CPU importing torch) starts this long after the new stages do.
WARM_AFTER_REBUILD_S = 10.0
LEAVE_WAIT_S = 60.0            # a leaving node waits this long for the driver's pipeline without it
HEADLESS_POLL_S = 0.1
REAP_S = 1.0
STOPPED_REAP_S = 5.0           # the driver stopped: its Shutdown passed, the stages exit (slowly on a loaded machine)
_control: dict[tuple[str, int], StoreServer] = {}     # (addr, port) -> the store this driver serves for all


def control_store(addr: str, port: int) -> StoreServer:
    """The store the driver serves for its generations (after `next_generation`)."""
    return _control[(addr, port)]


def next_generation(addr: str, port: int, key: bytes | None = None) -> int:
    """The driver starts a pipeline across nodes: its number, published in the store it serves
    on addr:port (made at the first call, with the cluster `key`, and kept for the life of this
    process). The other nodes stop their stages of older generations when they see it."""
    if (addr, port) not in _control:
        assert key is not None, "the first pipeline serves the store, with the cluster key"
        _control[(addr, port)] = serve_store(addr, port, key)
    return int(_control[(addr, port)].add(GENERATION_KEY, 1))


def publish_layout(addr: str, port: int, generation: int, layout: tuple[int, ...],
                   partition: tuple[int, ...] | None = None, options: str | None = None) -> None:
    """The generation's node of each stage, the driver's engine options (node_options.py) and, when
    the driver chose one, its layers per stage (all before the layout: a node reads them once the
    layout is there)."""
    store = control_store(addr, port)
    if options is not None:
        store.set(OPTIONS_KEY.format(generation=generation), options)
    if partition is not None:
        store.set(PARTITION_KEY.format(generation=generation), json.dumps(list(partition)))
    store.set(LAYOUT_KEY.format(generation=generation), json.dumps(list(layout)))


def await_nodes(addr: str, port: int, generation: int, nodes: list[int], timeout_s: float,
                first: int = 0) -> list[int]:
    """The nodes among `nodes` that are ready for `generation` within timeout_s (all: at once). A
    node that is leaving, or whose heartbeat stood still for SILENT_S, is not waited for once
    `first` nodes are ready (the first pipeline's --min-nodes, less the driver's)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = ready_nodes(addr, port, generation, nodes)
        waiting = [n for n in nodes if n not in ready and _absent(addr, port, n) is None]
        if (not waiting and len(ready) >= first) or time.monotonic() > deadline:
            return ready
        time.sleep(HEADLESS_POLL_S)


def _alive(addr: str, port: int, node: int) -> bool:
    """The node's heartbeat counter moved within SILENT_S (never: a node that is not up, or still
    warming up, is not waited for)."""
    since = control_store(addr, port).since_changed(ALIVE_KEY.format(node=node))
    return since is not None and since < SILENT_S


def nodes_gone(addr: str, port: int, nodes: list[int]):
    """A check for `abandon_when` while the driver links a pipeline on `nodes` up: one sentence once
    one of them asked to leave or stopped beating, else None."""
    if not nodes:
        return lambda: None

    def check() -> str | None:
        for node in nodes:
            if (why := _absent(addr, port, node)) is not None:
                gone = "" if why == LEFT else " (it is gone)"
                return f"node {node} {why} while the pipeline was linking up{gone}."
        return None
    return check


LEFT = "asked to leave"


def _absent(addr: str, port: int, node: int) -> str | None:
    """Why a rebuild need not wait for `node` (it asked to leave, or its heartbeat stood still), else None."""
    if leaving(addr, port, node):
        return LEFT
    return None if _alive(addr, port, node) else "stopped beating"


def leaving(addr: str, port: int, node: int) -> bool:
    """The node asked to leave the pipeline (SIGTERM on its headless process)."""
    store, key = control_store(addr, port), LEAVING_KEY.format(node=node)
    return store.check([key]) and store.get(key) == b"1"


def ready_nodes(addr: str, port: int, generation: int, nodes: list[int]) -> list[int]:
    """The nodes among `nodes` that said they are ready for `generation` (also too late for it)."""
    store = control_store(addr, port)
    return [n for n in nodes if store.check([READY_KEY.format(generation=generation, node=n)])]


def end_generations() -> None:
    """The driver builds no more pipelines: the headless nodes may exit."""
    for store in _control.values():
        try:
            store.set(STOPPED_KEY, "1")
        except Exception:  # noqa: BLE001  (the store is this process's own; nothing to report)
            pass


def run_headless(config, model_dir: str, eos_token_ids: tuple[int, ...]) -> int:
    """A non-driver node: run this node's stages in each pipeline the driver builds, until it
    stops building them (or, with --max-pipeline-restarts 0, until the first pipeline ends).
    When this node's stages fail, or the driver starts a new pipeline, the old stages are
    killed and new ones join the new pipeline. Once this node is measured, its warm process starts
    importing (executor/zygote.py), while the driver may still be starting; the node beats and
    says it is ready for a pipeline only once that process can fork stages, so a pipeline it
    joins (or one that moves stages here) waits for no import, and a rebuild meanwhile does not
    wait for it."""
    addr, port = config.cluster.master_addr, config.cluster.master_port
    heals = config.recovery.max_pipeline_restarts > 0
    token = cluster_token(config.cluster.cluster_token)
    warn_if_open(token, master_ip(addr), True)
    node_bytes = measured_node_bytes()      # before this node loads anything
    prepare_stage_env(config, addr)
    report = NodeReport.measure()           # NOTE: before the warm process imports on the same CPUs
    warm = config.recovery.pipeline_spares
    if warm:
        start_warm(model_dir)
    wait_s = max(config.cluster.dist_timeout_s, 300.0)
    try:
        store = join_store(addr, port, config.parallel.pp_size + 1, time.monotonic() + wait_s, wait_s, key_of(token))
        publish_report(store, config.cluster.node_rank, report)      # what the driver plans this node's share by
        if warm:          # NOTE: before it beats: a rebuild waits for no node that is still importing
            wait_warm(model_dir, wait_s)
        _serve_until_told(store, config.cluster.node_rank, lambda: join_store(addr, port, config.parallel.pp_size + 1,
                                                                      time.monotonic() + wait_s, wait_s, key_of(token)))
        last, code, told = 0, 1, set[str]()
        while (generation := _await_generation(store, last)) is not None:
            last = generation
            if warm:
                wait_warm(model_dir, wait_s)
            stages, partition = _join_generation(store, generation, config.cluster.node_rank)
            if not stages:          # left out (gone too long) or superseded: wait for the next one
                continue
            config = adopt_options(config, _options(store, generation), told)     # the driver's, not this node's
            heals = config.recovery.max_pipeline_restarts > 0
            # the driver's partition over the nodes it has (None: an older driver's; the options' stands)
            launch = Resolved(partition, node_bytes).launch_config(config)
            if generation > 1:
                log.warning("node %d joins the driver's pipeline %d with %s", config.cluster.node_rank, generation,
                            _stages_text(launch, model_dir, stages))
            else:
                log.info("node %d runs %s", config.cluster.node_rank, _stages_text(launch, model_dir, stages))
            try:
                procs = spawn_stages(launch, model_dir, config.cluster.node_rank, addr, port, eos_token_ids,
                                     generation=generation, stages=stages)
            except RuntimeError as exc:      # a stage died while starting: the driver sees it too
                log.error("%s", exc)
                if not heals:
                    return _exit(config, 1, "a stage failed to start and --max-pipeline-restarts is 0")
                continue
            # a warm process that died meanwhile starts again once the rebuilt pipeline recomputed
            warm_at = time.monotonic() + WARM_AFTER_REBUILD_S if warm else None
            code = _watch_stages(procs, store, generation, warm_at, lambda: start_warm(model_dir),
                                 config.cluster.node_rank)
            for p in procs:
                if p.is_alive():
                    p.kill()
            if code == 0:
                return _exit(config, 0, "the driver shut the pipeline down")
            if _leave.requested:
                return _exit(config, 0, "it left the pipeline (SIGTERM); the driver runs on without it")
            if not heals:
                return _exit(config, code, "its stages failed and --max-pipeline-restarts is 0")
        if _leave.requested:
            return _exit(config, 0, "it left the pipeline (SIGTERM)")
        return _exit(config, code, "the driver builds no more pipelines (it stopped, or it is gone)")
    except TimeoutError as exc:      # the driver never appeared
        log.error("%s", exc)
        return _exit(config, 1, "the driver never appeared")
    finally:             # a signal (SystemExit / KeyboardInterrupt) must not leave stages behind
        kill_local_stages()


def _stages_text(config, model_dir: str, stages: list[int]) -> str:
    """'stage(s) 1 (layers 15-29)': what this node runs, with the partition the driver resolves."""
    from ..checkpoint.facts import read_facts
    from ..parallel.partition import stage_infos
    from ..planning.stage_cost import resolve_partition
    facts = read_facts(model_dir)
    infos = stage_infos(facts.num_layers, config.parallel.pp_size, resolve_partition(config, facts))
    layers = ", ".join(f"{infos[s].start}-{infos[s].end - 1}" for s in stages)
    return f"stage(s) {', '.join(map(str, stages))} (layers {layers})"


def _exit(config, code: int, why: str) -> int:
    log.log(logging.INFO if code == 0 else logging.WARNING, "node %d exits with code %d: %s", config.cluster.node_rank,
            code, why)
    return code


def _await_generation(store: Store, last: int) -> int | None:
    """The driver's next pipeline after `last`, or None once it builds no more (or is gone)."""
    while True:
        if _leave.requested:
            return None
        try:
            if store.check([STOPPED_KEY]):
                return None
            generation = int(store.add(GENERATION_KEY, 0))
        except Exception:  # noqa: BLE001  (the driver's store closed: the driver exited)
            return None
        if generation > last:
            return generation
        time.sleep(HEADLESS_POLL_S)


def _join_generation(store: Store, generation: int, node: int) -> tuple[list[int], tuple[int, ...] | None]:
    """Say this node is ready for `generation`, then wait for its layout: this node's stages in it
    (none: the driver left this node out, or moved on to a newer generation, or stopped) and the
    generation's layer partition (None: the command line's)."""
    key = LAYOUT_KEY.format(generation=generation)
    try:
        store.set(READY_KEY.format(generation=generation, node=node), "1")
    except Exception:  # noqa: BLE001  (the driver's store closed: the driver exited)
        return [], None
    while not _leave.requested:
        try:
            if store.check([key]):
                stages = stages_of(tuple(json.loads(store.get(key))), node)
                if not stages:
                    log.warning("node %d is not in the driver's pipeline %d (it came too late); it joins the "
                                "next one", node, generation)
                return stages, _partition(store, generation)
            if store.check([STOPPED_KEY]) or int(store.add(GENERATION_KEY, 0)) != generation:
                return [], None
        except Exception:  # noqa: BLE001  (the driver's store closed: the driver exited)
            return [], None
        time.sleep(HEADLESS_POLL_S)
    return [], None


def _options(store: Store, generation: int) -> str | None:
    key = OPTIONS_KEY.format(generation=generation)
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001  (the driver's store closed: the stages' start fails and says so)
        return None


def _partition(store: Store, generation: int) -> tuple[int, ...] | None:
    key = PARTITION_KEY.format(generation=generation)
    return tuple(json.loads(store.get(key))) if store.check([key]) else None


class _Leave:
    """SIGTERM on a headless node: leave in order (the driver re-partitions without this node, then
    it exits); a second SIGTERM stops it at once."""
    requested = False
    announced = False
    since = 0.0


_leave = _Leave()


def _serve_until_told(store: Store, node: int, connect) -> None:
    """This node serves (clears an old leave), beats its alive counter on a connection of its own,
    and takes SIGTERM as a request to leave."""
    store.set(LEAVING_KEY.format(node=node), "0")
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        if _leave.requested and callable(previous):
            previous(signum, frame)
        _leave.requested, _leave.since = True, time.monotonic()
        log.warning("node %d leaves the pipeline: SIGTERM (a second one stops it at once)", node)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=_beat, args=(connect(), node), daemon=True, name="stagewise-alive").start()


def _beat(store: Store, node: int) -> None:
    while True:
        try:
            store.add(ALIVE_KEY.format(node=node), 1)
        except Exception:  # noqa: BLE001  (the driver's store closed: the main loop sees it too)
            return
        time.sleep(ALIVE_EVERY_S)


def _announce_leave(store: Store, node: int) -> None:
    if _leave.requested and not _leave.announced:
        store.set(LEAVING_KEY.format(node=node), "1")
        _leave.announced = True


def _watch_stages(procs: list, store: Store, generation: int, start_at: float | None, start,
                  node: int) -> int:
    """Wait until this node's stages end (0: all stopped in order), the driver starts a newer
    pipeline (1: at once) or stops or is gone (the stages' exit codes, after a moment to exit in
    order); `start` (the warm process) runs once at `start_at`. A leave asked for is announced here, and
    given up on (the stages stop, as in a failure) after LEAVE_WAIT_S."""
    while True:
        _announce_leave(store, node)
        if _leave.requested and time.monotonic() - _leave.since > LEAVE_WAIT_S:
            return 1
        if all(not p.is_alive() for p in procs) or any(p.exitcode not in (None, 0) for p in procs):
            return _reaped_code(procs)
        try:
            stopped = store.check([STOPPED_KEY])
            if not stopped and int(store.add(GENERATION_KEY, 0)) != generation:
                return 1
        except Exception:  # noqa: BLE001  (the driver's store closed: the driver exited)
            stopped = True
        if stopped:
            return _reaped_code(procs, STOPPED_REAP_S)
        if start_at is not None and time.monotonic() >= start_at:
            start()
            start_at = None
        time.sleep(HEADLESS_POLL_S)


def _reaped_code(procs: list, wait_s: float = REAP_S) -> int:
    """0 if every stage exited 0 (within wait_s each), else 1."""
    for p in procs:
        p.join(wait_s)
    return 0 if all(p.exitcode == 0 for p in procs) else 1
