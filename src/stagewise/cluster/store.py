"""The rendezvous store node 0 serves on --master-addr:--master-port: a small key-value map (add,
set, get, check) that the ranks meet in, behind the cluster-token handshake (cluster/auth.py).

It replaces torch's TCPStore, which has no authentication, where stagewise serves the store itself;
under torchrun the ranks use the agent's TCPStore (rendezvous.py). After the handshake a request
is a length-prefixed JSON array [op, args...] and its answer ["ok", value] or ["err", why], sealed
with the connection's keys (cluster/transport.py's SealedSocket).
"""
from __future__ import annotations

import errno
import json
import socket
import struct
import threading
import time

from ..errors import ClusterAuthError
from .auth import STORE, Gate, Hello, LinkKeys, dial_handshake
from .netif import master_ip
from .transport import SealedSocket

FRAME = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 20
MAX_KEY_CHARS = 512
MAX_KEYS = 100_000
CONNECT_RETRY_S = 0.3


class StoreServer:
    """The store, served on addr:port from threads of this process; the process uses it directly."""

    def __init__(self, addr: str, port: int, key: bytes):
        self.listener = listen_on(addr, port)
        self.data: dict[str, str] = {}
        self.changed: dict[str, float] = {}      # key -> when its value last changed (monotonic)
        self.lock = threading.Lock()
        self.closed = False
        self.gate = Gate(f"the rendezvous store on {addr}:{self.listener.getsockname()[1]}", key, self._serve)
        threading.Thread(target=self.gate.serve, args=(self.listener,), daemon=True, name="stagewise-store").start()

    # the map (also what remote requests run)
    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, "0")) + amount
            self._put(key, str(value))
            return value

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self._put(key, value.decode() if isinstance(value, bytes) else value)

    def get(self, key: str) -> bytes:
        with self.lock:
            if key not in self.data:
                raise KeyError(f"no key {key!r} in the rendezvous store")
            return self.data[key].encode()

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def since_changed(self, key: str) -> float | None:
        """Seconds since `key` last changed here (None: never set); what node heartbeats are judged by."""
        with self.lock:
            when = self.changed.get(key)
        return None if when is None else time.monotonic() - when

    def _put(self, key: str, value: str) -> None:
        if key not in self.data and len(self.data) >= MAX_KEYS:
            raise ValueError("the rendezvous store is full")
        if self.data.get(key) != value:
            self.changed[key] = time.monotonic()
        self.data[key] = value

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)     # NOTE: close alone does not wake accept() on Linux
        except OSError:
            pass
        self.listener.close()

    # serving
    def _serve(self, raw: socket.socket, hello: Hello, peer, keys: LinkKeys | None) -> None:
        """A connection that proved the key: answer its requests until it closes."""
        with raw:
            if hello.purpose != STORE:
                self.gate.refusals.refused(peer, "it asked for something else than the store")
                return
            sock = SealedSocket(raw, keys, f"a store client at {peer[0]}")
            try:
                while not self.closed:
                    request = _read_frame(sock)
                    if request is None:
                        return
                    _write_frame(sock, self._answer(request))
            except (OSError, ValueError, RecursionError):
                return

    def _answer(self, request) -> list:
        try:
            op, *args = request
            if op == "add" and _keys_ok(args[:1]) and type(args[1]) is int:
                return ["ok", self.add(args[0], args[1])]
            if op == "set" and _keys_ok(args[:1]) and type(args[1]) is str and len(args[1]) <= MAX_FRAME_BYTES:
                self.set(args[0], args[1])
                return ["ok", None]
            if op == "get" and _keys_ok(args[:1]):
                return ["ok", self.get(args[0]).decode()]
            if op == "check" and type(args[0]) is list and _keys_ok(args[0]):
                return ["ok", self.check(args[0])]
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            return ["err", str(exc)]
        return ["err", "unknown or malformed request"]


class StoreClient:
    """A connection to node 0's store (StoreServer), with the same four calls."""

    def __init__(self, addr: str, port: int, key: bytes, deadline: float, timeout_s: float):
        self.where, self.timeout_s = f"the rendezvous at {addr}:{port}", timeout_s
        self.lock = threading.Lock()
        self.sock = SealedSocket(*dial(addr, port, key, Hello(STORE), self.where, deadline, timeout_s), self.where)
        self.sock.settimeout(timeout_s)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value.decode() if isinstance(value, bytes) else value)

    def get(self, key: str) -> bytes:
        return self._call("get", key).encode()

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def close(self) -> None:
        self.sock.close()

    def _call(self, *request):
        with self.lock:
            _write_frame(self.sock, list(request))
            answer = _read_frame(self.sock)
        if answer is None:
            raise ConnectionError(f"{self.where} closed the connection")
        status, value = answer
        if status != "ok":
            raise KeyError(value) if request[0] == "get" else ValueError(value)
        return value


def listen_on(addr: str, port: int) -> socket.socket:
    """A listening socket on addr:port only (not every interface), with one-sentence errors."""
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
    return sock


def connect_until(addr: str, port: int, deadline: float, timeout_s: float) -> socket.socket:
    """A TCP connection to addr:port, retried in short tries until `deadline`."""
    while True:
        try:
            return socket.create_connection((addr, port), timeout=1.0)
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Nothing answered at --master-addr {addr}:{port} within {timeout_s:.0f} s; "
                                   f"start node 0 with the same --master-addr and --master-port, and let TCP "
                                   f"port {port} through between the hosts.") from None
            time.sleep(CONNECT_RETRY_S)


def dial(addr: str, port: int, key: bytes, hello: Hello, where: str, deadline: float,
         timeout_s: float) -> tuple[socket.socket, LinkKeys | None]:
    """A connection to addr:port that passed the handshake, and its keys; retried until `deadline`
    while nothing answers or the listener is busy; ClusterAuthError at once if the token is refused."""
    while True:
        sock = connect_until(addr, port, deadline, timeout_s)
        try:
            return sock, dial_handshake(sock, key, hello, where)
        except ConnectionError:
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{where[:1].upper()}{where[1:]} kept closing the connection for "
                                   f"{timeout_s:.0f} s.") from None
            time.sleep(CONNECT_RETRY_S)
        except ClusterAuthError:
            sock.close()
            raise


def _keys_ok(keys: list) -> bool:
    return all(type(k) is str and len(k) <= MAX_KEY_CHARS for k in keys)


def _write_frame(sock: SealedSocket, value) -> None:
    text = json.dumps(value, separators=(",", ":")).encode()
    sock.sendall(FRAME.pack(len(text)) + text)


def _read_frame(sock: SealedSocket):
    """The next JSON frame, None at a clean end; ValueError for a frame past the limit or not JSON."""
    head = _read(sock, FRAME.size)
    if head is None:
        return None
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError("a store frame past the limit")
    body = _read(sock, size)
    if body is None:
        return None
    return json.loads(body)


def _read(sock: SealedSocket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
