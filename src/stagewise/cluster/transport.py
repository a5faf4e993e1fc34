"""Point-to-point links between pipeline ranks: one TCP connection each, authenticated (auth.py)
before it carries anything, then framed messages, sealed.

A frame is a prefix (magic, header length), a JSON header [tensor table, message] and the raw
bytes of each tensor in table order; the table ([dtype, shape] each) is checked against the
limits below before anything is allocated. Sends are asynchronous and in order (a thread per
link; `PendingSend.wait` like an isend's), so a stage can post its output and go on receiving.
Receives take a deadline and wait in short slices, so the main thread's signal handlers run.

Sealed (a link opened with the handshake's keys): the frames travel as records of at most
RECORD_BYTES, each AES-256-GCM under the direction's key with its sequence number as the nonce and
its length as associated data, so a record changed, replayed, dropped, reordered or reflected fails
to open and closes the link (LinkError). A message starts a new record, so at a message boundary
nothing is left buffered (a select on the socket still says whether a message is coming).
"""
from __future__ import annotations

import functools
import json
import math
import queue
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from .auth import LinkKeys

# torch is imported when a tensor is sent or received: the rendezvous store and the watchdog use
# this module in processes that never load torch (serve's HTTP front process)
if TYPE_CHECKING:
    import torch

PREFIX = struct.Struct("!4sI")        # magic, header bytes
MAGIC = b"SWM1"
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_TENSOR_BYTES = 8 << 30            # all tensors of one message together
RECORD = struct.Struct("!I")          # a sealed record's length (ciphertext and tag), in the clear
RECORD_BYTES = 1 << 20                # plaintext per record at most
COALESCE_BYTES = 256 << 10            # parts of a message up to this much together go in one record
TAG_BYTES = 16
WAIT_SLICE_S = 0.25                   # receives return to Python this often (signal handlers run)
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch
    return {name: getattr(torch, name) for name in DTYPE_NAMES}


class LinkError(ConnectionError):
    """The link closed, broke, or carried something that is not a message."""


class Sealer:
    """One direction of a sealed connection: AES-256-GCM under its key, the record count as nonce.
    Its buffer is reused record after record (a record is sent, or its plaintext read, before the next)."""

    def __init__(self, key: bytes):
        # NOTE: cryptography loads on a process's first sealed link (~9 MiB a one-process engine never needs)
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        self.aead, self.seq, self.buf = AESGCM(key), 0, bytearray()

    def _nonce(self) -> bytes:
        self.seq += 1
        return (self.seq - 1).to_bytes(12, "big")

    def _room(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]

    def records(self, parts: list):
        """`parts` (bytes-like) as records, each [length, ciphertext] and valid until the next is made:
        small parts together (one copy), a large one (a tensor) in place."""
        small, made = bytearray(), False
        for part in parts:
            view = memoryview(part).cast("B")
            if len(small) + len(view) <= COALESCE_BYTES:
                small += view
                continue
            if small:
                yield self._record(small)
                small = bytearray()
            for start in range(0, len(view), RECORD_BYTES):
                made = True
                yield self._record(view[start:start + RECORD_BYTES])
        if small or not made:
            yield self._record(small)

    def seal(self, parts: list) -> list[bytes]:
        """All of `parts` sealed, as bytes (the store's small requests)."""
        return [bytes(piece) for record in self.records(parts) for piece in record]

    def _record(self, plain) -> list:
        head = RECORD.pack(len(plain) + TAG_BYTES)
        out = self._room(len(plain) + TAG_BYTES)
        self.aead.encrypt_into(self._nonce(), plain, head, out)
        return [head, out]

    def open(self, head: bytes, sealed, peer: str) -> memoryview:
        """A record's plaintext (valid until the next is opened); LinkError if it is not the next
        record this key sealed."""
        from cryptography.exceptions import InvalidTag
        out = self._room(len(sealed) - TAG_BYTES)
        try:
            self.aead.decrypt_into(self._nonce(), sealed, head, out)
        except InvalidTag:
            raise LinkError(f"{peer} sent a record that fails its integrity check (changed, replayed, reordered "
                            f"or not sealed with this link's key); the link is closed") from None
        return out


def record_size(head: bytes, peer: str) -> int:
    """The sealed length a record header names; LinkError past the limit (nothing allocated yet)."""
    (size,) = RECORD.unpack(head)
    if not TAG_BYTES <= size <= RECORD_BYTES + TAG_BYTES:
        raise LinkError(f"{peer} sent a record of {size} bytes, which no sealed link sends; the link is closed")
    return size


class SealedSocket:
    """A connected socket whose bytes travel sealed (the store's requests): `sendall` and `recv`
    like a blocking socket's, with the socket's own timeout."""

    def __init__(self, sock: socket.socket, keys: LinkKeys | None, peer: str):
        self.sock, self.peer = sock, peer
        self.sealer = Sealer(keys.send) if keys else None
        self.opener = Sealer(keys.recv) if keys else None
        self.plain = b""

    def settimeout(self, timeout_s: float | None) -> None:
        self.sock.settimeout(timeout_s)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(b"".join(self.sealer.seal([data])) if self.sealer else data)

    def recv(self, n: int) -> bytes:
        """Up to n bytes; b"" at a clean end between records."""
        if self.opener is None:
            return self.sock.recv(n)
        if not self.plain:
            head = self._exactly(RECORD.size)
            if not head:
                return b""
            body = self._exactly(record_size(head, self.peer))
            if not body:
                raise LinkError(f"the link to {self.peer} closed inside a record")
            self.plain = bytes(self.opener.open(head, body, self.peer))
        out, self.plain = self.plain[:n], self.plain[n:]
        return out

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return b""
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


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
    """A connected, authenticated socket to one peer, sealed with `keys` (the handshake's) if given.
    One thread receives; any thread may send."""

    def __init__(self, sock: socket.socket, peer: str, keys: LinkKeys | None = None):
        if sock.family != socket.AF_UNIX:         # a stage's tensor-parallel ranks talk over a local socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock, self.peer = sock, peer
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.sender: threading.Thread | None = None
        self.sealer = Sealer(keys.send) if keys else None
        self.opener = Sealer(keys.recv) if keys else None
        self.plain = memoryview(b"")          # opened bytes not yet read
        self.head = bytearray(RECORD.size)    # the record being received: its header,
        self.body = bytearray()               # its body (the buffer is reused),
        self.size: int | None = None          # its body's size once the header is in,
        self.got = 0                          # and its bytes received so far (kept across a timeout)

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
                    if self.sealer is None:
                        _send_all(self.sock, pending.parts)
                    for record in self.sealer.records(pending.parts) if self.sealer else ():
                        _send_all(self.sock, record)
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
        import torch
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
        if self.opener is None:
            self._fill(view, 0, deadline, timeout_s)
            return
        got = 0
        while got < len(view):
            if not len(self.plain):
                self.plain = memoryview(self._next_record(deadline, timeout_s))
            n = min(len(view) - got, len(self.plain))
            view[got:got + n] = self.plain[:n]
            self.plain, got = self.plain[n:], got + n

    def _next_record(self, deadline: float, timeout_s: float) -> memoryview:
        """The next record's plaintext. A timeout keeps what arrived of it for the next call."""
        assert self.opener is not None
        if self.closed:
            raise LinkError(f"the link to {self.peer} is closed")
        try:
            if self.size is None:
                self._fill(memoryview(self.head), self.got, deadline, timeout_s, keep=True)
                self.size, self.got = record_size(bytes(self.head), self.peer), 0
                if len(self.body) < self.size:
                    self.body = bytearray(self.size)
            body = memoryview(self.body)[:self.size]
            self._fill(body, self.got, deadline, timeout_s, keep=True)
            plain = self.opener.open(bytes(self.head), body, self.peer)
        except LinkError:
            self.abort()              # a forged or broken record: nothing more is read from this link
            raise
        self.size, self.got = None, 0
        return plain

    def _fill(self, view: memoryview, got: int, deadline: float, timeout_s: float, keep: bool = False) -> int:
        """Fill view[got:] from the socket; on a timeout with `keep`, self.got says how far it came."""
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                if keep:
                    self.got = got
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
        return got

    def readable(self) -> bool:
        return bool(len(self.plain)) or bool(select.select([self.sock], [], [], 0)[0])

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
        ok = type(entry) is list and len(entry) == 2 and entry[0] in DTYPE_NAMES and type(entry[1]) is list
        shape = entry[1] if ok else []
        if not ok or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise LinkError(f"{peer} sent a tensor with an unknown dtype or a bad shape: {str(entry)[:80]}")
        dtype = _dtypes()[entry[0]]
        total += math.prod(shape) * dtype.itemsize
        if total > MAX_TENSOR_BYTES:
            raise LinkError(f"{peer} sent tensors of more than {MAX_TENSOR_BYTES >> 30} GiB in one message")
        out.append((dtype, shape))
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as bytes (shared, not copied)."""
    import torch
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
