"""The links of one pipeline, opened once every rank has joined the rendezvous: each rank's ring
neighbours (driver → stage 0 → … → last stage → driver) and each stage's control link to the
driver (ready, heartbeats). Every rank listens on its network interface for the links it expects,
says where in the store, dials the ones it owes, and closes the listener once all are up; every
connection proves the cluster token first (cluster/auth.py), and one of another attempt or with
an unexpected identity is refused; each link is sealed with its handshake's keys.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from .auth import CONTROL, RING, Gate, Hello, LinkKeys, session_of
from .layout import DRIVER_RANK, ring_next, ring_prev
from .netif import link_address, use_interface
from .rendezvous import RDZV_POLL_S, Store, attempt_name, check_abandoned, close_store, rendezvous, torchrun_env
from .store import dial
from .transport import Link

log = logging.getLogger("stagewise.executor")


@dataclass
class PipelineLinks:
    """A rank's ring links, `prev` (it receives) and `next` (it sends); on the driver `controls`,
    each stage's control link (by stage), on a stage `control`, its own."""
    rank: int
    prev: Link
    next: Link
    controls: list[Link] = field(default_factory=list)
    control: Link | None = None

    def all(self) -> list[Link]:
        return [self.prev, self.next, *self.controls, *([self.control] if self.control else [])]

    def abort(self) -> None:
        """Wake whatever waits on a link of this pipeline (it sees the link closed)."""
        for link in self.all():
            link.abort()

    def close(self) -> None:
        for link in self.all():
            link.close()


def join_pipeline(rank: int, world_size: int, addr: str, port: int, timeout_s: float, key: bytes,
                  generation: int | None = None, store: Store | None = None,
                  dist_ifname: str | None = None) -> PipelineLinks:
    """Rendezvous as `rank` and open this rank's links. `generation` (multi-node only) is the
    driver's pipeline number, `store` the one the driver serves for all of them (rank 0 only)."""
    env = torchrun_env()
    if env and env["world_size"] != world_size:
        raise ValueError(f"torchrun started {env['world_size']} processes but --pp-size {world_size - 1} needs "
                         f"{world_size} (one driver + one per stage); use --nproc-per-node {world_size}.")
    use_interface(addr, dist_ifname)
    lasting = store is not None
    store = rendezvous(rank, world_size, addr, port, timeout_s, generation, store, key)
    try:
        return open_links(rank, world_size, store, attempt_name(generation), link_address(addr), key, timeout_s)
    finally:
        if not lasting:          # the links are up (or failed): nobody of this attempt needs the store again
            close_store(store)


def open_links(rank: int, world_size: int, store: Store, prefix: str, host: str, key: bytes,
               timeout_s: float) -> PipelineLinks:
    deadline = time.monotonic() + timeout_s
    session = session_of(prefix)
    expected = {(RING, ring_prev(rank, world_size))}
    if rank == DRIVER_RANK:
        expected |= {(CONTROL, r) for r in range(1, world_size)}
    acceptor = Acceptor(host, key, session, rank, expected)
    dialled: dict[tuple[int, int], Link] = {}
    try:
        store.set(f"{prefix}/link{rank}", json.dumps(acceptor.address))
        owed = [(RING, ring_next(rank, world_size))] + ([(CONTROL, DRIVER_RANK)] if rank != DRIVER_RANK else [])
        for purpose, to in owed:
            dialled[(purpose, to)] = _dial(store, prefix, key, Hello(purpose, rank, to, session), deadline, timeout_s)
        got = acceptor.wait(deadline, timeout_s)
    except BaseException:
        for link in [*dialled.values(), *acceptor.got.values()]:
            link.close()
        raise
    finally:
        acceptor.close()
    ring = (got[(RING, ring_prev(rank, world_size))], dialled[(RING, ring_next(rank, world_size))])
    if rank == DRIVER_RANK:
        return PipelineLinks(rank, *ring, controls=[got[(CONTROL, r)] for r in range(1, world_size)])
    return PipelineLinks(rank, *ring, control=dialled[(CONTROL, DRIVER_RANK)])


def _dial(store: Store, prefix: str, key: bytes, hello: Hello, deadline: float, timeout_s: float) -> Link:
    """Dial rank `hello.to_rank` once it has said where it listens."""
    name = f"{prefix}/link{hello.to_rank}"
    while not store.check([name]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_rank_name(hello.to_rank).capitalize()} did not open its links within "
                               f"{timeout_s:.0f} s.")
        check_abandoned()
        time.sleep(RDZV_POLL_S / 2)
    host, port = json.loads(store.get(name))
    where = f"{_rank_name(hello.to_rank)} at {host}:{port}"
    sock, keys = dial(host, port, key, hello, where, deadline, timeout_s)
    return Link(sock, where, keys)


class Acceptor:
    """Accepts the links a rank expects (cluster/auth.py's Gate: each after its handshake)."""

    def __init__(self, host: str, key: bytes, session: int, rank: int, expected: set[tuple[int, int]]):
        self.listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.address = list(self.listener.getsockname()[:2])
        self.session, self.rank, self.expected = session, rank, expected
        self.got: dict[tuple[int, int], Link] = {}
        self.done = threading.Condition()
        self.gate = Gate(f"{_rank_name(rank)}'s link listener", key, self._admit)
        threading.Thread(target=self.gate.serve, args=(self.listener,), daemon=True, name="stagewise-accept").start()

    def _admit(self, sock: socket.socket, hello: Hello, peer, keys: LinkKeys | None) -> None:
        ident = (hello.purpose, hello.from_rank)
        with self.done:
            if hello.session != self.session or hello.to_rank != self.rank or ident not in self.expected \
                    or ident in self.got:
                self.gate.refusals.refused(peer, "it is not a link this rank expects (another pipeline attempt?)")
                sock.close()
                return
            self.got[ident] = Link(sock, f"{_rank_name(hello.from_rank)} at {peer[0]}", keys)
            self.done.notify_all()

    def wait(self, deadline: float, timeout_s: float) -> dict[tuple[int, int], Link]:
        with self.done:
            while set(self.got) != self.expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted({_rank_name(r) for _, r in self.expected - set(self.got)})
                    raise TimeoutError(f"{', '.join(missing).capitalize()} did not link to {_rank_name(self.rank)} "
                                       f"within {timeout_s:.0f} s.")
                check_abandoned()
                self.done.wait(min(left, RDZV_POLL_S))
            return dict(self.got)

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)     # NOTE: close alone does not wake accept() on Linux
        except OSError:
            pass
        self.listener.close()


def _rank_name(rank: int) -> str:
    return "the driver" if rank == DRIVER_RANK else f"stage {rank - 1}"
