"""The tensor-parallel ranks of one stage, all on the stage's node. Rank 0 (the leader) is the stage
in the pipeline's ring; it forwards every ring message to the other ranks (followers) over a local
socket, so every rank runs the same plans in the same order and their collectives meet
(parallel/groups.py). Only the leader passes results on; a follower that fails exits, and the
driver, which watches every rank's process, rebuilds the pipeline as after a stage's death.
"""
from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time

from ..cluster.transport import Link
from ..kernels import comm
from ..parallel import groups
from .messages import (
    CONTROL,
    READY_WAIT_S,
    Message,
    PlanFailedMsg,
    PlanMsg,
    ReadyMsg,
    ResultMsg,
    Shutdown,
    recv_message,
    send_message,
)

_RANK = struct.Struct("<q")
POLL_S = 0.05


def new_directory() -> str:
    """A private directory (mode 0700, in memory where /dev/shm exists) for one stage's ranks to meet."""
    return tempfile.mkdtemp(prefix="stagewise-tp-", dir=comm.shm_dir())


def _socket_path(directory: str) -> str:
    return os.path.join(directory, "leader.sock")


class Leader:
    """Rank 0's side: makes the group, accepts the followers' links, forwards messages to them."""

    def __init__(self, directory: str, size: int, timeout_s: float):
        self.directory, self.size = directory, size
        groups.prepare(directory, size)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(_socket_path(directory))
            listener.listen(size)
            self.group = groups.open_group(directory, 0, size, timeout_s)
            self.links = _accept(listener, size, READY_WAIT_S)
        finally:
            listener.close()
        self.pending: list = []

    def await_ready(self, memory_plan) -> None:
        """Every follower's ReadyMsg: an error raises; the stage's KV pool is the smallest rank's.
        Then the meeting directory goes (the ranks hold their group open)."""
        for rank, link in enumerate(self.links, 1):
            msg = recv_message(link, READY_WAIT_S, CONTROL)
            if not isinstance(msg, ReadyMsg) or msg.error is not None or msg.memory_plan is None:
                raise RuntimeError(f"tensor-parallel rank {rank}: {getattr(msg, 'error', msg)}")
            memory_plan.num_blocks = min(memory_plan.num_blocks, msg.memory_plan.num_blocks)
        shutil.rmtree(self.directory, ignore_errors=True)

    def forward(self, msg: Message, timeout_s: float) -> None:
        """Send `msg` to every follower (once the previous message is sent: bounded memory)."""
        for p in self.pending:
            p.wait(timeout_s)
        self.pending = [send_message(link, msg) for link in self.links]
        if isinstance(msg, Shutdown):
            for p in self.pending:
                p.wait(timeout_s)

    def check_in_step(self, msg: Message, out: Message) -> None:
        check_in_step(self.group, msg, out)

    def close(self) -> None:
        for link in getattr(self, "links", []):
            link.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def check_in_step(group, msg: Message, out: Message) -> None:
    """A plan that failed on this rank may have skipped collectives the other ranks still wait in:
    every rank's waits end (abort), and this rank's process too, so the pipeline is rebuilt.
    NOTE: a failure that every rank would share (a bad request) costs a rebuild too, for now."""
    failed = isinstance(out, PlanFailedMsg) or (isinstance(out, ResultMsg) and out.result.error is not None)
    if isinstance(msg, PlanMsg) and failed:
        if hasattr(group, "abort"):
            group.abort()
        raise RuntimeError("a plan failed on this tensor-parallel rank, so the stage's ranks are out of step.")


def _accept(listener: socket.socket, size: int, timeout_s: float) -> list[Link]:
    links: dict[int, Link] = {}
    listener.settimeout(timeout_s)
    while len(links) < size - 1:
        sock, _ = listener.accept()
        (rank,) = _RANK.unpack(_recv_exactly(sock, _RANK.size))
        if not 0 < rank < size or rank in links:
            sock.close()
            raise RuntimeError(f"a tensor-parallel follower said it is rank {rank} of {size}.")
        links[rank] = Link(sock, f"tensor-parallel rank {rank}")
    return [links[r] for r in range(1, size)]


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a tensor-parallel follower closed its link while greeting")
        data += chunk
    return data


def connect_to_leader(directory: str, rank: int, timeout_s: float) -> Link:
    """A follower's link to its leader (once the leader listens, within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_socket_path(directory))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stage's tensor-parallel rank 0 did not listen within {timeout_s:.0f} s.") \
                    from None
            time.sleep(POLL_S)
    sock.sendall(_RANK.pack(rank))
    return Link(sock, "tensor-parallel rank 0")


def serve_follower(config, model_dir: str, stage, eos_ids, directory: str, rank: int, handle) -> None:
    """A follower's life: open the group, build its shard, say ready, then run what the leader forwards
    (`handle(worker, stage, msg)`: what a stage does with a ring message)."""
    from ..runtime.worker import Worker
    link = connect_to_leader(directory, rank, READY_WAIT_S)
    try:
        group = groups.open_group(directory, rank, config.parallel.tp_size, config.cluster.dist_timeout_s)
        t0 = time.monotonic()
        try:
            worker = Worker(config, model_dir, stage, eos_ids, tp_group=group)
        except Exception as exc:
            send_message(link, ReadyMsg(error=str(exc))).wait()
            raise
        send_message(link, ReadyMsg(worker.memory_plan, time.monotonic() - t0)).wait()
        wait_s = max(config.cluster.dist_timeout_s, READY_WAIT_S)   # the first message comes once every stage is ready
        while True:
            msg = recv_message(link, wait_s)
            wait_s = config.cluster.dist_timeout_s
            check_in_step(group, msg, handle(worker, stage, msg))
            if isinstance(msg, Shutdown):
                return
    finally:
        link.close()


def check_tp(config, model_dir: str) -> None:
    """One sentence, before any process starts, when `config.parallel.tp_size` ranks cannot split this model here."""
    from ..checkpoint.facts import read_facts
    from ..cluster.rendezvous import torchrun_env
    from ..model.loader import _architecture
    from ..model.registry import get_model_class
    from ..parallel import tp
    from ..runtime.threads import usable_cpus
    if torchrun_env():
        raise ValueError("torchrun starts one process per stage; run tensor parallelism (--tp-size) without "
                         "torchrun, with --nnodes for several machines.")
    hf = read_facts(model_dir).hf
    tp.check_model(hf, get_model_class(_architecture(hf, model_dir)), config.parallel.tp_size)
    cpus = usable_cpus()
    if config.parallel.tp_size > cpus.cpus:
        raise ValueError(f"--tp-size {config.parallel.tp_size} needs a CPU per rank, but this machine gives "
                         f"{cpus.cpus} ({cpus.why}); use --tp-size {cpus.cpus} or less.")
