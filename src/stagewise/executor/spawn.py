"""Starting stage processes: this node's stages of a pipeline (`spawn_stages`), forked from the
node's warm process (executor/zygote.py: torch and the engine imported once, any stage and layer
range forked in milliseconds) or, without one, spawned fresh (each imports torch: seconds to a
minute on a slow node). The pipes here are the parent's own (inherited, unnamed); nothing else can
reach them.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_sentinels

from ..cluster.layout import default_layout, stages_of
from ..cluster.netif import use_interface
from ..planning.resolved import Resolved
from ..runtime.threads import log_once, spawn_env_defaults, thread_choice
from . import zygote
from .hygiene import track
from .stage_proc import stage_main
from .tp_ranks import new_directory

log = logging.getLogger("stagewise.executor")
_warm: list[zygote.Zygote] = []     # this node's warm process (at most one)
_retired: list[zygote.Zygote] = []  # warm processes started under other load-time variables, whose stages may run
_never: list[str] = []              # why warm processes cannot work in this process (then stages spawn fresh)


def spawn_stages(config, model_dir: str, node_rank: int, addr: str, port: int, eos_token_ids,
                 models: dict | None = None, startup_timeout_s: float = 300.0, generation: int | None = None,
                 stages: list[int] | None = None) -> list:
    """Start this node's stage processes (`stages`, default: the command line's layout; with tensor
    parallelism `tp_size` per stage, rank by rank): forked from the warm process with
    --pipeline-spares (the default; started now if there is none, and waited for), else spawned, in
    which case wait until each has started running stage code, so a process that dies while
    bootstrapping is reported at once, not after a rendezvous timeout."""
    prepare_stage_env(config, addr)
    ctx = mp.get_context("spawn")
    procs: list = []
    spawned: dict[Connection, object] = {}    # a pipe per spawned stage: its first message says the stage code runs
    if stages is None:
        stages = stages_of(default_layout(config.parallel.pp_size, config.cluster.nnodes), node_rank)
    config = Resolved(local_stages=tuple(stages)).launch_config(config)   # their share of the node's memory, CPUs
    warm = wait_warm(model_dir, startup_timeout_s) if config.recovery.pipeline_spares else None
    for s, tp in ((s, tp) for s in stages for tp in _tp_ranks(config.parallel.tp_size)):
        args = (config, model_dir, s, addr, port, eos_token_ids, True, models, generation, tp)
        name = f"stagewise-stage-{s}" + (f"-rank-{tp[0]}" if tp else "")
        p = _fork(warm, args, name) if warm is not None else None
        if p is None:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=stage_main, name=name, daemon=True, args=(*args, writer))
            p.start()
            track(p)
            writer.close()
            spawned[reader] = p
        procs.append(p)
    _await_started(procs, spawned, startup_timeout_s)
    return procs


def _fork(warm: zygote.Zygote, args: tuple, name: str):
    """A stage forked from the warm process, or None (it is gone: the stage is spawned instead)."""
    try:
        return warm.fork(args, name)
    except (EOFError, OSError, RuntimeError) as exc:
        log.warning("%s starts fresh: %s", name, exc)
        return None


def _tp_ranks(tp_size: int) -> list:
    """Each rank's (rank, meeting directory) of one stage's tensor-parallel group; [None] without TP."""
    if tp_size == 1:
        return [None]
    directory = new_directory()
    return [(rank, directory) for rank in range(tp_size)]


def _await_started(procs: list, spawned: dict, startup_timeout_s: float) -> None:
    """Wait until each spawned stage runs stage code (forked ones do at once); a death kills them all."""
    pending, deadline = dict(spawned), time.monotonic() + startup_timeout_s
    while pending and time.monotonic() < deadline:
        for ready in wait_sentinels(list(pending) + [p.sentinel for p in pending.values()], timeout=1.0):
            if isinstance(ready, Connection) and ready in pending and ready.poll():
                ready.recv()
                pending.pop(ready)
                continue
            dead = next((p for p in procs if not p.is_alive()), None)
            if dead is not None:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{dead.name} exited with code {dead.exitcode} while starting. If your script "
                                   "creates LLM(pp_size>1) at import time, guard it with "
                                   "`if __name__ == '__main__':`.")
    if pending:
        raise RuntimeError(f"stage processes did not start within {startup_timeout_s:.0f} s.")


def prepare_stage_env(config, addr: str) -> None:
    """The environment stage processes start with (they inherit it; a value the user set wins)."""
    # NOTE: children read it before their OpenMP starts.
    wait = spawn_env_defaults()
    threads, why = thread_choice(config)
    log_once(f"CPU threads: {threads} per stage process ({why}); OpenMP wait in stages: {wait}")
    use_interface(addr, config.cluster.dist_ifname)


def start_warm(model_dir: str) -> zygote.Zygote | None:
    """This node's warm process: started now unless one runs (or warm processes cannot work here).
    Call after `prepare_stage_env`: it keeps the environment it starts with (a later change of a
    variable that libraries read as they load retires it, and the next call starts another)."""
    if _never or not zygote.supported():
        return None
    if _warm:
        _warm[0].wait_warm(0.0)          # read what it said (it may have gone cold)
    if _warm and _warm[0].usable():
        return _warm[0]
    if _warm and _warm[0].cold not in (None, zygote.GONE):
        _never.append(_warm[0].cold)             # NOTE: it would go cold again: spawn from now on
        return None
    if _warm:
        _retired.append(_warm.pop())       # NOTE: not stopped: stages forked from it die with it
    _warm.append(zygote.Zygote(model_dir))
    return _warm[0]


def wait_warm(model_dir: str, timeout_s: float) -> zygote.Zygote | None:
    """The warm process once it has imported everything (started if needed, waited for up to
    timeout_s: as long as a fresh stage would import), or None: stages spawn fresh."""
    warm = start_warm(model_dir)
    if warm is None:
        return None
    t0 = time.monotonic()
    if not warm.wait_warm(timeout_s):
        return None
    if warm.warm_s is None:
        warm.warm_s = time.monotonic() - warm.started_at
        log_once(f"the warm process (stagewise-warm) started in {warm.warm_s:.1f} s; stages fork from it")
    if time.monotonic() - t0 > 1.0:
        log.info("waited %.1f s for the warm process to finish its imports", time.monotonic() - t0)
    return warm


def warm_ready() -> int:
    """1 while this node's warm process is ready to fork stages, else 0."""
    return int(bool(_warm) and _warm[0].usable() and _warm[0].wait_warm(0.0))


def stop_warm() -> None:
    """End this node's warm processes (stages forked from them, if any still run, end with them)."""
    while _warm or _retired:
        (_warm or _retired).pop().stop()
