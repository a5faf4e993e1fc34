"""Starting stage processes: this node's stages of a pipeline (`spawn_stages`), and spare
processes that import what a stage needs ahead of time and wait to be given a stage, so a pipeline
rebuilt after a failure skips seconds of start-up. The pipes here are the parent's own (inherited,
unnamed); nothing else can reach them.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_sentinels

from ..runtime.threads import log_once, spawn_env_defaults, thread_choice
from .hygiene import track
from .idle_priority import spare_main
from .layout import default_layout, stages_of
from .netif import use_interface
from .stage_proc import stage_main
from .tp_ranks import new_directory

_spares: list = []             # [process, duplex pipe, warm]: started stage processes waiting for a stage to run


def spawn_stages(config, model_dir: str, node_rank: int, addr: str, port: int, eos_token_ids,
                 models: dict | None = None, startup_timeout_s: float = 300.0, generation: int | None = None,
                 stages: list[int] | None = None) -> list:
    """Start this node's stage processes (`stages`, default: the command line's layout; with tensor
    parallelism `tp_size` per stage, rank by rank) and wait until each has started running stage
    code, so a process that dies while bootstrapping is reported at once, not after a rendezvous timeout."""
    prepare_stage_env(config, addr)
    ctx = mp.get_context("spawn")
    procs: list = []
    readers: list[Connection] = []        # a pipe per stage: its first message says the stage code runs
    if stages is None:
        stages = stages_of(default_layout(config.parallel.pp_size, config.cluster.nnodes), node_rank)
    config = config.replace(local_stages=tuple(stages))     # their share of this node's memory and CPUs
    for s, tp in ((s, tp) for s in stages for tp in _tp_ranks(config.parallel.tp_size)):
        args = (config, model_dir, s, addr, port, eos_token_ids, True, models, generation, tp)
        name = f"stagewise-stage-{s}" + (f"-rank-{tp[0]}" if tp else "")
        spare = _take_spare()
        if spare is not None:                 # a warm process: it runs the stage at once
            p, reader = spare
            p.name = name
            reader.send(args)
        else:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=stage_main, name=name, daemon=True, args=(*args, writer))
            p.start()
            track(p)
            writer.close()
        procs.append(p)
        readers.append(reader)
    _await_started(procs, readers, startup_timeout_s)
    return procs


def _tp_ranks(tp_size: int) -> list:
    """Each rank's (rank, meeting directory) of one stage's tensor-parallel group; [None] without TP."""
    if tp_size == 1:
        return [None]
    directory = new_directory()
    return [(rank, directory) for rank in range(tp_size)]


def _await_started(procs: list, readers: list[Connection], startup_timeout_s: float) -> None:
    pending, deadline = dict(zip(readers, procs)), time.monotonic() + startup_timeout_s
    while pending and time.monotonic() < deadline:
        for ready in wait_sentinels(list(pending) + [p.sentinel for p in pending.values()], timeout=1.0):
            if ready in pending and ready.poll():
                if ready.recv() != "warm":    # a spare that was still importing says so first
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


def start_spares(count: int, model_dir: str) -> None:
    """Start `count` spare stage processes (beyond those waiting already): each imports what a
    stage needs (torch, transformers, the model code), then waits for a stage to run. Call after
    `spawn_stages` (the spares inherit the environment it prepared)."""
    ctx = mp.get_context("spawn")
    for _ in range(count - len(_spares)):
        here, there = ctx.Pipe(duplex=True)
        p = ctx.Process(target=spare_main, args=(there, model_dir), name="stagewise-stage-spare", daemon=True)
        p.start()
        there.close()
        track(p)
        _spares.append([p, here, False])


def spares_ready() -> int:
    """Spare processes done importing (they said "warm")."""
    for spare in _spares:
        if not spare[2] and spare[0].is_alive() and spare[1].poll():
            spare[1].recv()
            spare[2] = True
    return sum(1 for p, _, warm in _spares if warm and p.is_alive())


def _take_spare():
    """A living spare, warm ones first (one still importing sends "warm" before `started`)."""
    spares_ready()
    _spares.sort(key=lambda spare: not spare[2])
    while _spares:
        p, conn, _ = _spares.pop(0)
        if p.is_alive():
            return p, conn
        conn.close()
    return None


def stop_spares() -> None:
    """End the spare processes (closing its pipe ends one; SIGKILL if it lingers)."""
    while _spares:
        p, conn, _ = _spares.pop()
        conn.close()
        p.join(1.0)
        if p.is_alive():
            p.kill()
