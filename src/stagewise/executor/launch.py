"""Rank layout and process-group setup shared by the driver and the stage processes.

World = pp_size + 1 ranks: rank 0 is the driver (it owns the scheduler), rank s+1 runs
stage s. Messages travel a ring: driver → stage 0 → … → last stage → driver. Node n of
`nnodes` hosts stages [n*k, (n+1)*k) for k = pp_size / nnodes; node 0 also hosts the driver.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
from datetime import timedelta

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
