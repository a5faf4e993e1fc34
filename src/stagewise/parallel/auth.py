"""The cluster token: every connection of a pipeline (the rendezvous store, each stage link) opens
with a mutual HMAC-SHA256 challenge-response over the token before a byte of it is interpreted.

The listening side speaks first (a magic and a fresh nonce), then reads a fixed-size answer (the
dialler's nonce, a fixed-size hello naming who dials and why, and their MAC) and checks the MAC
before looking at the hello; a wrong MAC closes the connection. It then proves the token in turn,
so a dialler never talks to an impostor either. Traffic after the handshake is neither encrypted
nor signed (docs/security.md: Cluster links).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .. import envs
from ..errors import ClusterAuthError

log = logging.getLogger("stagewise.executor")

TOKEN_ENV = "STAGEWISE_CLUSTER_TOKEN"
MAGIC = b"stagewise-link/1"           # 16 bytes: what a listener says first
NONCE_BYTES = 32
MAC_BYTES = 32
HELLO = struct.Struct("!BHHQ")        # purpose, from rank, to rank, session
ANSWER_BYTES = NONCE_BYTES + HELLO.size + MAC_BYTES
HANDSHAKE_S = 10.0                    # a peer that does not finish its handshake within this is dropped
REFUSAL_LOG_S = 10.0                  # at most one log line per listener per this many seconds about refusals
MAX_HANDSHAKES = 32                   # connections a listener lets prove the token at once (a flood costs no more)
STORE, RING, CONTROL = 1, 2, 3        # purposes: the rendezvous store, a ring link, a stage's control link
_warned = False


@dataclass(frozen=True)
class Hello:
    """Who dials, and for what: checked by the listener once the MAC holds."""
    purpose: int
    from_rank: int = 0
    to_rank: int = 0
    session: int = 0                  # the pipeline attempt (session_of): links of another attempt are refused

    def pack(self) -> bytes:
        return HELLO.pack(self.purpose, self.from_rank, self.to_rank, self.session)


def session_of(name: str) -> int:
    """A 64-bit number for a pipeline attempt's name (its key prefix in the store)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def cluster_token(given: str | None) -> str | None:
    """The token: --cluster-token, else $STAGEWISE_CLUSTER_TOKEN, else None."""
    return given or envs.STAGEWISE_CLUSTER_TOKEN


def key_of(token: str | None) -> bytes:
    """The HMAC key of a token. No token is the empty key: the handshake still runs, but proves nothing."""
    return hashlib.sha256(b"stagewise cluster token\0" + (token or "").encode()).digest() if token else b""


def new_token() -> str:
    """A random token for a pipeline whose processes all start on this host (they inherit it)."""
    return secrets.token_hex(16)


def warn_if_open(token: str | None, master_ip: str, multi_node: bool) -> None:
    """One warning line per process (and per node under torchrun) when a multi-node pipeline runs
    without a token on an interface other hosts can reach."""
    global _warned
    if _warned or token or not multi_node or ipaddress.ip_address(master_ip).is_loopback:
        return
    _warned = True
    if os.environ.get("LOCAL_RANK", "0") == "0":
        log.warning("no --cluster-token (or %s) is set: any host that reaches %s can join this pipeline and "
                    "send it messages; give every node the same secret token (docs/security.md)", TOKEN_ENV,
                    master_ip)


def serve_handshake(sock: socket.socket, key: bytes) -> Hello:
    """The listener's side: ClusterAuthError (and the connection closed) unless the peer proves the key."""
    sock.settimeout(HANDSHAKE_S)
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + nonce)
        answer = _read_exactly(sock, ANSWER_BYTES)
        theirs, hello, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:-MAC_BYTES], answer[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(key, b"dial", nonce, theirs, hello)):
            raise ClusterAuthError("the peer did not prove the cluster token")
        sock.sendall(_mac(key, b"listen", theirs, nonce, hello))
    except (OSError, EOFError, ClusterAuthError) as exc:
        sock.close()
        raise ClusterAuthError(str(exc) or type(exc).__name__) from None
    sock.settimeout(None)
    return Hello(*HELLO.unpack(hello))


def dial_handshake(sock: socket.socket, key: bytes, hello: Hello, where: str) -> None:
    """The dialler's side: ClusterAuthError unless the listener at `where` accepts our proof and proves
    the key; ConnectionError (worth a retry) if it closes before its greeting (busy, or going away)."""
    sock.settimeout(HANDSHAKE_S)
    try:
        greeting = _read_exactly(sock, len(MAGIC) + NONCE_BYTES)
    except (OSError, EOFError) as exc:
        raise ConnectionError(f"{where} closed the connection before its greeting ({exc})") from None
    if greeting[:len(MAGIC)] != MAGIC:
        raise ClusterAuthError(_sentence(f"{where} is not a stagewise pipeline (it answered something else); "
                                         f"check --master-addr and --master-port."))
    theirs, nonce, packed = greeting[len(MAGIC):], secrets.token_bytes(NONCE_BYTES), hello.pack()
    try:
        sock.sendall(nonce + packed + _mac(key, b"dial", theirs, nonce, packed))
        proof = _read_exactly(sock, MAC_BYTES)
    except EOFError:
        raise ClusterAuthError(_sentence(f"{where} refused this node: its cluster token differs; give every node "
                                         f"the same --cluster-token or {TOKEN_ENV}.")) from None
    except OSError as exc:
        raise ClusterAuthError(_sentence(f"the handshake with {where} failed ({exc}).")) from None
    if not hmac.compare_digest(proof, _mac(key, b"listen", nonce, theirs, packed)):
        raise ClusterAuthError(_sentence(f"{where} did not prove the cluster token, so it is not this pipeline's; "
                                         f"give every node the same --cluster-token or {TOKEN_ENV}."))
    sock.settimeout(None)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


class Gate:
    """A listener's door: each accepted connection proves the key in a thread of its own (a peer that
    stalls delays nobody), at most MAX_HANDSHAKES at once; `admit(sock, hello, peer)` gets the ones that did."""

    def __init__(self, what: str, key: bytes, admit: Callable[[socket.socket, Hello, tuple], None]):
        self.key, self.admit, self.refusals = key, admit, RefusalLog(what)
        self.slots = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def serve(self, listener: socket.socket) -> None:
        """Accept until the listener closes (a thread's loop)."""
        while True:
            try:
                sock, peer = listener.accept()
            except OSError:
                return
            if not self.slots.acquire(blocking=False):
                sock.close()
                self.refusals.refused(peer, f"{MAX_HANDSHAKES} connections are proving the token already")
                continue
            threading.Thread(target=self._greet, args=(sock, peer), daemon=True, name="stagewise-greet").start()

    def _greet(self, sock: socket.socket, peer) -> None:
        try:
            hello = serve_handshake(sock, self.key)
        except ClusterAuthError as exc:
            self.refusals.refused(peer, str(exc))
            return
        finally:
            self.slots.release()
        self.admit(sock, hello, peer)


class RefusalLog:
    """Says that connections were refused, at most once per REFUSAL_LOG_S (a scan must not flood the log)."""

    def __init__(self, what: str):
        self.what, self.last, self.count = what, -REFUSAL_LOG_S, 0

    def refused(self, peer, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= REFUSAL_LOG_S:
            log.warning("%s refused a connection from %s: %s (%d refused so far)", self.what, _host(peer), why,
                        self.count)
            self.last = now


def _host(peer) -> str:
    return peer[0] if isinstance(peer, tuple) and peer else str(peer)


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, role + b"\0" + b"".join(parts), hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the connection closed during the handshake")
        buf += chunk
    return bytes(buf)
