"""Rank layout and process-group setup shared by the driver and the stage processes.

World = pp_size + 1 ranks: rank 0 is the driver (it owns the scheduler), rank s+1 runs
stage s. Messages travel a ring: driver → stage 0 → … → last stage → driver. Node n of
`nnodes` hosts stages [n*k, (n+1)*k) for k = pp_size / nnodes; node 0 also hosts the driver.
Rank 0 serves the rendezvous store on --master-addr only; every rank waits for the others in
short Python steps, so SIGINT/SIGTERM are handled while a node waits for its peers.

Across nodes (not torchrun) each pipeline the driver builds is a generation of one lasting store
(executor/generations.py) and rendezvouses under its own key prefix.
"""
from __future__ import annotations

import ctypes
import errno
import multiprocessing as mp
import os
import signal
import socket
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_sentinels

import torch.distributed as dist

from ..runtime.threads import log_once, spawn_env_defaults, thread_choice
from .netif import master_ip, use_interface

DRIVER_RANK = 0
RDZV_POLL_S = 0.1
_local_stages: weakref.WeakSet = weakref.WeakSet()     # every stage process this process started
_spares: list = []             # [process, duplex pipe, warm]: started stage processes waiting for a stage to run


def stage_rank(stage: int) -> int:
    return stage + 1


def default_layout(pp_size: int, nnodes: int) -> tuple[int, ...]:
    """The node of each stage as the command line gives it: k = pp_size / nnodes consecutive stages each."""
    k = pp_size // nnodes
    return tuple(s // k for s in range(pp_size))


def stages_of(layout: tuple[int, ...], node_rank: int) -> list[int]:
    return [s for s, node in enumerate(layout) if node == node_rank]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, addr: str, port: int, timeout_s: float,
               generation: int | None = None, store: dist.Store | None = None) -> None:
    """Join the process group; `generation` (multi-node only) is the driver's pipeline number,
    `store` the one the driver serves for all of them (rank 0 only)."""
    env = torchrun_env()
    if env and env["world_size"] != world_size:
        raise ValueError(f"torchrun started {env['world_size']} processes but --pp-size {world_size - 1} needs "
                         f"{world_size} (one driver + one per stage); use --nproc-per-node {world_size}.")
    use_interface(addr)       # NOTE: before the group exists: gloo reads GLOO_SOCKET_IFNAME when it is built
    store = rendezvous(rank, world_size, addr, port, timeout_s, generation, store)
    if generation is not None:      # NOTE: the group's own keys restart with each group: keep them apart
        store = dist.PrefixStore(f"stagewise/pg{generation}", store)
    # NOTE: gloo on CPU and for GPU host staging; proxies are small next to compute here.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def rendezvous(rank: int, world_size: int, addr: str, port: int, timeout_s: float,
               generation: int | None = None, store: dist.Store | None = None) -> dist.Store:
    """Join the store at addr:port (rank 0 serves it, unless torchrun's agent does, or passes the
    `store` it serves already) and wait until every rank has joined, polling so the Python signal
    handlers keep running."""
    deadline = time.monotonic() + timeout_s
    if store is None:
        if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            store = serve_store(addr, port, world_size, timeout_s)
        else:
            store = join_store(addr, port, world_size, deadline, timeout_s)
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" + (f".{generation}" if generation else "")
    keys = [f"stagewise/{attempt}/rank{r}" for r in range(world_size)]
    if store.add(keys[rank], 1) > 1:
        raise ValueError(f"Two processes joined the pipeline at {addr}:{port} as rank {rank}; "
                         f"give every node its own --node-rank.")
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(_missing_ranks(store, keys, addr, port, timeout_s))
        time.sleep(RDZV_POLL_S)
    return store


def serve_store(addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(addr, port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=_listen(addr, port))


def join_store(addr: str, port: int, world_size: int, deadline: float, timeout_s: float) -> dist.TCPStore:
    _await_store(addr, port, deadline, timeout_s)
    return dist.TCPStore(addr, port, world_size, False, timedelta(seconds=timeout_s))


def _missing_ranks(store: dist.Store, keys: list[str], addr: str, port: int, timeout_s: float) -> str:
    missing = [f"stage {r - 1}" if r else "the driver" for r, key in enumerate(keys) if not store.check([key])]
    return (f"{', '.join(missing).capitalize()} did not join the rendezvous at {addr}:{port} within "
            f"{timeout_s:.0f} s; start every node with the same --master-addr, --master-port and --pp-size.")


def _listen(addr: str, port: int) -> int:
    """A listening socket on addr:port for the store (TCPStore alone would listen on every interface)."""
    ip = master_ip(addr)
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((ip, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--master-addr {addr} is not an address of this host, yet node 0 serves the "
                             f"rendezvous there; run --node-rank 0 on the host that owns {addr}.") from None
        raise ValueError(f"Cannot serve the rendezvous on {addr}:{port} ({exc.strerror}); "
                         f"choose a free --master-port.") from None
    sock.listen(128)
    return sock.detach()


def _await_store(addr: str, port: int, deadline: float, timeout_s: float) -> None:
    """Wait until the store accepts connections, in short tries (TCPStore's own retry blocks signals)."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Nothing answered at --master-addr {addr}:{port} within {timeout_s:.0f} s; "
                                   f"start node 0 with the same --master-addr and --master-port, and let TCP "
                                   f"port {port} through between the hosts.") from None
            time.sleep(RDZV_POLL_S * 3)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no stage outlives its driver."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:   # the parent died before prctl took effect
        os._exit(1)


def name_process(name: str) -> None:
    """Linux: the process's name in ps/top (/proc/PID/comm, at most 15 bytes), e.g. stagewise-st1."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)   # PR_SET_NAME
    except OSError:
        return


def kill_local_stages() -> None:
    """SIGKILL every stage process this process started and is still running."""
    for p in list(_local_stages):
        if p.is_alive():
            p.kill()


def torchrun_env() -> dict | None:
    """(rank, world_size, addr, port) when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "port": int(os.environ.get("MASTER_PORT", "29500"))}


def spawn_stages(config, model_dir: str, node_rank: int, addr: str, port: int, eos_token_ids,
                 models: dict | None = None, startup_timeout_s: float = 300.0, generation: int | None = None,
                 stages: list[int] | None = None) -> list:
    """Start this node's stage processes (`stages`, default: the command line's layout) and wait
    until each has started running stage code, so a process that dies while bootstrapping is
    reported at once, not after a rendezvous timeout."""
    prepare_stage_env(config, addr)
    from .stage_proc import stage_main
    ctx = mp.get_context("spawn")
    procs: list = []
    readers: list[Connection] = []        # a pipe per stage: its first message says the stage code runs
    if stages is None:
        stages = stages_of(default_layout(config.pp_size, config.nnodes), node_rank)
    for s in stages:
        args = (config, model_dir, s, addr, port, eos_token_ids, True, models, generation)
        spare = _take_spare()
        if spare is not None:                 # a warm process: it runs the stage at once
            p, reader = spare
            p.name = f"stagewise-stage-{s}"
            reader.send(args)
        else:
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=stage_main, name=f"stagewise-stage-{s}", daemon=True, args=(*args, writer))
            p.start()
            _local_stages.add(p)
            writer.close()
        procs.append(p)
        readers.append(reader)
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
    return procs


def prepare_stage_env(config, addr: str) -> None:
    """The environment stage processes start with (they inherit it; a value the user set wins)."""
    # NOTE: children read it before their OpenMP starts.
    wait = spawn_env_defaults()
    threads, why = thread_choice(config)
    log_once(f"CPU threads: {threads} per stage process ({why}); OpenMP wait in stages: {wait}")
    use_interface(addr, config.dist_ifname)


def start_spares(count: int, model_dir: str) -> None:
    """Start `count` spare stage processes (beyond those waiting already): each imports what a
    stage needs (torch, transformers, the model code), then waits for a stage to run, so a
    pipeline rebuilt after a failure skips seconds of start-up. Call after `spawn_stages` (the
    spares inherit the environment it prepared)."""
    from .stage_proc import standby_main
    ctx = mp.get_context("spawn")
    for _ in range(count - len(_spares)):
        here, there = ctx.Pipe(duplex=True)
        p = ctx.Process(target=standby_main, args=(there, model_dir), name="stagewise-stage-spare", daemon=True)
        p.start()
        there.close()
        _local_stages.add(p)
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
