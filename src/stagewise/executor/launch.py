"""Rank layout and process-group setup shared by the driver and the stage processes.

World = pp_size + 1 ranks: rank 0 is the driver (it owns the scheduler), rank s+1 runs
stage s. Messages travel a ring: driver → stage 0 → … → last stage → driver. Node n of
`nnodes` hosts stages [n*k, (n+1)*k) for k = pp_size / nnodes; node 0 also hosts the driver.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import socket
import time
from datetime import timedelta
from multiprocessing.connection import wait as wait_sentinels

import torch.distributed as dist

DRIVER_RANK = 0


def stage_rank(stage: int) -> int:
    return stage + 1


def local_stages(pp_size: int, nnodes: int, node_rank: int) -> list[int]:
    k = pp_size // nnodes
    return list(range(node_rank * k, (node_rank + 1) * k))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, addr: str, port: int, timeout_s: float) -> None:
    backend = "gloo"   # NOTE: gloo on CPU and for GPU host staging; proxies are small next to compute here.
    env = torchrun_env()
    if env and env["world_size"] != world_size:
        raise ValueError(f"torchrun started {env['world_size']} processes but --pp-size {world_size - 1} needs "
                         f"{world_size} (one driver + one per stage); use --nproc-per-node {world_size}.")
    # NOTE: under torchrun the agent already serves a store on MASTER_PORT: join it via env://.
    init_method = "env://" if env else f"tcp://{addr}:{port}"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no stage outlives its driver."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def torchrun_env() -> dict | None:
    """(rank, world_size, addr, port) when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "port": int(os.environ.get("MASTER_PORT", "29500"))}


def spawn_stages(config, model_dir: str, node_rank: int, addr: str, port: int, eos_token_ids,
                 models: dict | None = None, startup_timeout_s: float = 300.0) -> list[mp.Process]:
    """Start this node's stage processes and wait until each has started running stage code,
    so a process that dies while bootstrapping is reported at once, not after a rendezvous timeout."""
    # NOTE: stages share cores; OpenMP's default spin-waiting makes small ops many times slower
    # there. Children inherit this; a value the user set wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .stage_proc import stage_main
    ctx = mp.get_context("spawn")
    procs, readers = [], []
    for s in local_stages(config.pp_size, config.nnodes, node_rank):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=stage_main, name=f"stagewise-stage-{s}", daemon=True,
                        args=(config, model_dir, s, addr, port, eos_token_ids, True, models, writer))
        p.start()
        writer.close()
        procs.append(p)
        readers.append(reader)
    pending, deadline = dict(zip(readers, procs)), time.monotonic() + startup_timeout_s
    while pending and time.monotonic() < deadline:
        for ready in wait_sentinels(list(pending) + [p.sentinel for p in pending.values()], timeout=1.0):
            if ready in pending and ready.poll():
                pending.pop(ready)
                continue
            dead = next((p for p in procs if not p.is_alive()), None)
            if dead is not None:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{dead.name} exited with code {dead.exitcode} while starting. If your script "
                                   f"creates LLM(pp_size>1) at import time, guard it with `if __name__ == '__main__':`.")
    if pending:
        raise RuntimeError(f"stage processes did not start within {startup_timeout_s:.0f} s.")
    return procs


def run_headless(config, model_dir: str, eos_token_ids: tuple[int, ...]) -> int:
    """A non-driver node: run this node's stages until the driver shuts them down."""
    procs = spawn_stages(config, model_dir, config.node_rank, config.master_addr, config.master_port, eos_token_ids)
    for p in procs:
        p.join()
    return max((p.exitcode or 0) for p in procs)
