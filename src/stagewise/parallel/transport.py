"""Point-to-point links between pipeline ranks: one TCP connection each, authenticated (auth.py)
before it carries anything, then framed messages.

A frame is a prefix (magic, header length), a JSON header [tensor table, message] and the raw
bytes of each tensor in table order; the table ([dtype, shape] each) is checked against the
limits below before anything is allocated. Sends are asynchronous and in order (a thread per
link; `PendingSend.wait` like an isend's), so a stage can post its output and go on receiving.
Receives take a deadline and wait in short slices, so the main thread's signal handlers run.
"""
from __future__ import annotations

import json
import math
import queue
import select
import socket
import struct
import threading
import time
from typing import Any

import torch

PREFIX = struct.Struct("!4sI")        # magic, header bytes
MAGIC = b"SWM1"
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_TENSOR_BYTES = 8 << 30            # all tensors of one message together
WAIT_SLICE_S = 0.25                   # receives return to Python this often (signal handlers run)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class LinkError(ConnectionError):
    """The link closed, broke, or carried something that is not a message."""


class PendingSend:
    """One queued message: `wait` returns once it is written to the socket."""

    def __init__(self, link: "Link", parts: list):
        self.link, self.parts, self.done, self.error = link, parts, threading.Event(), None

    def wait(self, timeout_s: float | None = None) -> None:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"sending to {self.link.peer} timed out after {timeout_s:.3g} s")
        if self.error is not None:
            raise LinkError(f"sending to {self.link.peer} failed: {self.error}")


class Link:
    """A connected, authenticated socket to one peer. One thread receives; any thread may send."""

    def __init__(self, sock: socket.socket, peer: str):
        if sock.family != socket.AF_UNIX:         # a stage's tensor-parallel ranks talk over a local socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock, self.peer = sock, peer
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.sender: threading.Thread | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    # sending
    def send(self, header: Any, tensors: list[torch.Tensor]) -> PendingSend:
        """Queue one message: `header` (JSON-able) and `tensors`, sent raw after it."""
        # NOTE: host staging: tensors move as CPU bytes, also between two stages on one GPU
        flat = [t.detach().cpu().contiguous() for t in tensors]
        table = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in flat]
        text = json.dumps([table, header], separators=(",", ":")).encode()
        parts = [PREFIX.pack(MAGIC, len(text)), text] + [_bytes_of(t) for t in flat if t.numel()]
        pending = PendingSend(self, parts)
        if self.sender is None:
            self.sender = threading.Thread(target=self._send_loop, daemon=True, name="stagewise-send")
            self.sender.start()
        self.queue.put(pending)
        return pending

    def _send_loop(self) -> None:
        error = None
        while True:
            pending = self.queue.get()
            if pending is None:
                return
            if error is None and self.closed:
                error = "the link is closed"
            if error is None:
                try:
                    _send_all(self.sock, pending.parts)
                except OSError as exc:
                    error = str(exc) or type(exc).__name__
            pending.error, pending.parts = error, []
            pending.done.set()

    # receiving
    def recv(self, timeout_s: float) -> tuple[Any, list[torch.Tensor]]:
        """The next message's header and tensors; TimeoutError if none completes within timeout_s."""
        deadline = time.monotonic() + timeout_s
        magic, size = PREFIX.unpack(self._read(PREFIX.size, deadline, timeout_s))
        if magic != MAGIC or size > MAX_HEADER_BYTES:
            raise LinkError(f"{self.peer} sent something that is not a message frame")
        try:
            table, header = json.loads(self._read(size, deadline, timeout_s))
        except (ValueError, TypeError, RecursionError):
            raise LinkError(f"{self.peer} sent a message whose header is not valid JSON") from None
        tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in _checked_table(table, self.peer)]
        for t in tensors:
            if t.numel():
                self._read_into(memoryview(_bytes_of(t)), deadline, timeout_s)
        return header, tensors

    def _read(self, n: int, deadline: float, timeout_s: float) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf), deadline, timeout_s)
        return bytes(buf)

    def _read_into(self, view: memoryview, deadline: float, timeout_s: float) -> None:
        got = 0
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"receiving from {self.peer} timed out after {timeout_s:.3g} s")
            ready, _, _ = select.select([self.sock], [], [], min(left, WAIT_SLICE_S))
            if not ready:
                continue
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise LinkError(f"the link to {self.peer} broke: {exc}") from None
            if n == 0:
                raise LinkError(f"the link to {self.peer} closed")
            got += n

    def readable(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def abort(self) -> None:
        """Wake any thread blocked on this link (its receive sees the link closed); sends fail from now."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.abort()
        if self.sender is not None:
            self.queue.put(None)
        self.sock.close()


def _checked_table(table: Any, peer: str) -> list[tuple[torch.dtype, list[int]]]:
    """The tensor table, or LinkError if it names an unknown dtype or shapes past the limits."""
    if type(table) is not list or len(table) > MAX_TENSORS:
        raise LinkError(f"{peer} sent a message with a malformed tensor table")
    out, total = [], 0
    for entry in table:
        ok = type(entry) is list and len(entry) == 2 and entry[0] in DTYPES and type(entry[1]) is list
        shape = entry[1] if ok else []
        if not ok or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise LinkError(f"{peer} sent a tensor with an unknown dtype or a bad shape: {str(entry)[:80]}")
        dtype = DTYPES[entry[0]]
        total += math.prod(shape) * dtype.itemsize
        if total > MAX_TENSOR_BYTES:
            raise LinkError(f"{peer} sent tensors of more than {MAX_TENSOR_BYTES >> 30} GiB in one message")
        out.append((dtype, shape))
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as bytes (shared, not copied)."""
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _send_all(sock: socket.socket, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:64])
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
