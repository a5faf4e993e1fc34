"""The rendezvous: every rank of a pipeline joins one store (node 0's StoreServer, or torchrun's
agent store) and waits until all have, in short Python steps so SIGINT/SIGTERM are handled while
a node waits for its peers. Across nodes (not torchrun) each pipeline the driver builds is a
generation of one lasting store (executor/generations.py) and rendezvouses under its own key prefix.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Protocol

from .store import StoreClient, StoreServer, connect_until

RDZV_POLL_S = 0.1
_abandon: list[Callable[[], str | None]] = []    # while this process links a pipeline up: why to give up


@contextmanager
def abandon_when(check: Callable[[], str | None]) -> Iterator[None]:
    """While linking a pipeline up, `check()` (one sentence, or None) is asked at every wait: a node
    that left or died meanwhile ends the attempt at once instead of at the timeout."""
    _abandon.append(check)
    try:
        yield
    finally:
        _abandon.remove(check)


def check_abandoned() -> None:
    for check in _abandon:
        if (why := check()) is not None:
            raise TimeoutError(why)


class Store(Protocol):
    """What the ranks use of a store: ours (store.py) or torch's TCPStore under torchrun."""

    def add(self, key: str, amount: int) -> int: ...
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def torchrun_env() -> dict | None:
    """(rank, world_size, addr, port) when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "port": int(os.environ.get("MASTER_PORT", "29500"))}


def uses_agent_store() -> bool:
    """torchrun's agent serves the store on MASTER_ADDR:MASTER_PORT (it has no authentication)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attempt_name(generation: int | None = None) -> str:
    """The key prefix of this pipeline attempt: torchrun's restart count, and the driver's generation."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + (f".{generation}" if generation else "")
    return f"stagewise/{attempt}"


def rendezvous(rank: int, world_size: int, addr: str, port: int, timeout_s: float, generation: int | None = None,
               store: Store | None = None, key: bytes = b"") -> Store:
    """Join the store at addr:port (rank 0 serves it, unless torchrun's agent does, or passes the
    `store` it serves already) and wait until every rank has joined."""
    deadline = time.monotonic() + timeout_s
    if store is None:
        if rank == 0 and not uses_agent_store():
            store = serve_store(addr, port, key)
        else:
            store = join_store(addr, port, world_size, deadline, timeout_s, key)
    keys = [f"{attempt_name(generation)}/rank{r}" for r in range(world_size)]
    if store.add(keys[rank], 1) > 1:
        raise ValueError(f"Two processes joined the pipeline at {addr}:{port} as rank {rank}; "
                         f"give every node its own --node-rank.")
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(_missing_ranks(store, keys, addr, port, timeout_s))
        check_abandoned()
        time.sleep(RDZV_POLL_S)
    return store


def serve_store(addr: str, port: int, key: bytes) -> StoreServer:
    return StoreServer(addr, port, key)


def join_store(addr: str, port: int, world_size: int, deadline: float, timeout_s: float, key: bytes) -> Store:
    if uses_agent_store():
        import torch.distributed as dist
        connect_until(addr, port, deadline, timeout_s).close()    # TCPStore's own retry blocks signals
        return dist.TCPStore(addr, port, world_size, False, timedelta(seconds=timeout_s))
    return StoreClient(addr, port, key, deadline, timeout_s)


def close_store(store: Store) -> None:
    close = getattr(store, "close", None)       # torch's TCPStore has none: dropping it closes it
    if close is not None:
        close()


def _missing_ranks(store: Store, keys: list[str], addr: str, port: int, timeout_s: float) -> str:
    missing = [f"stage {r - 1}" if r else "the driver" for r, key in enumerate(keys) if not store.check([key])]
    return (f"{', '.join(missing).capitalize()} did not join the rendezvous at {addr}:{port} within "
            f"{timeout_s:.0f} s; start every node with the same --master-addr, --master-port and --pp-size.")
