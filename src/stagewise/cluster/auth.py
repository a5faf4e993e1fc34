"""The cluster token: every connection of a pipeline (the rendezvous store, each stage link) opens
with a mutual HMAC-SHA256 challenge-response over the token before a byte of it is interpreted.

The listening side speaks first (a magic and a fresh nonce), then reads a fixed-size answer (the
dialler's nonce, a fixed-size hello naming who dials and why, and their MAC) and checks the MAC
before looking at the hello; a wrong MAC closes the connection. It then proves the token in turn,
so a dialler never talks to an impostor either.

Each side's nonce is also a fresh X25519 public key: once both proofs hold, the two sides derive a
pair of per-connection keys (HKDF-SHA256 over the ephemeral shared secret and the token's key, salted
with both nonces, one key per direction) that seal every later frame (transport.py). Without a token
the exchange still hides the traffic from a passive observer but proves nobody (docs/security.md).
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
from typing import TYPE_CHECKING, Callable

from .. import envs
from ..errors import ClusterAuthError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

log = logging.getLogger("stagewise.executor")

TOKEN_ENV = "STAGEWISE_CLUSTER_TOKEN"
MAGIC = b"stagewise-link/1"           # 16 bytes: what a listener says first
NONCE_BYTES = 32                      # a fresh X25519 public key: the challenge and the key exchange at once
MAC_BYTES = 32
HELLO = struct.Struct("!BHHQ")        # purpose, from rank, to rank, session
ANSWER_BYTES = NONCE_BYTES + HELLO.size + MAC_BYTES
HANDSHAKE_S = 10.0                    # a peer that does not finish its handshake within this is dropped
REFUSAL_LOG_S = 10.0                  # at most one log line per listener per this many seconds about refusals
MAX_HANDSHAKES = 32                   # connections a listener lets prove the token at once (a flood costs no more)
STORE, RING, CONTROL = 1, 2, 3        # purposes: the rendezvous store, a ring link, a stage's control link
KEYS_INFO = b"stagewise link keys/1\0"
# NOTE: not a setting. benchmarks/pipeline/link_crypto.py turns it off in every process of a run to measure the
# cost of sealing; both ends of a link must agree (a sealed frame is not a message frame to a plain end)
SEAL_LINKS = True
_warned = False


@dataclass(frozen=True)
class LinkKeys:
    """A connection's two AES-256-GCM keys: what this side seals with, and what it opens with."""
    send: bytes
    recv: bytes

    def __repr__(self) -> str:                 # never in a log or a traceback
        return "LinkKeys(...)"


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


def serve_handshake(sock: socket.socket, key: bytes) -> tuple[Hello, LinkKeys | None]:
    """The listener's side: ClusterAuthError (and the connection closed) unless the peer proves the key;
    the dialler's hello and the connection's keys (None where SEAL_LINKS is off)."""
    sock.settimeout(HANDSHAKE_S)
    ours = _new_key_share()
    nonce = ours.public_key().public_bytes_raw()
    try:
        sock.sendall(MAGIC + nonce)
        answer = _read_exactly(sock, ANSWER_BYTES)
        theirs, hello, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:-MAC_BYTES], answer[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(key, b"dial", nonce, theirs, hello)):
            raise ClusterAuthError("the peer did not prove the cluster token")
        keys = _derive(ours, theirs, key, nonce, theirs, hello, dialler=False)
        sock.sendall(_mac(key, b"listen", theirs, nonce, hello))
    except (OSError, EOFError, ClusterAuthError) as exc:
        sock.close()
        raise ClusterAuthError(str(exc) or type(exc).__name__) from None
    sock.settimeout(None)
    return Hello(*HELLO.unpack(hello)), keys


def dial_handshake(sock: socket.socket, key: bytes, hello: Hello, where: str) -> LinkKeys | None:
    """The dialler's side: the connection's keys (None where SEAL_LINKS is off); ClusterAuthError
    unless the listener at `where` accepts our proof and proves the key; ConnectionError (worth a
    retry) if it closes before its greeting (busy, or going away)."""
    sock.settimeout(HANDSHAKE_S)
    try:
        greeting = _read_exactly(sock, len(MAGIC) + NONCE_BYTES)
    except (OSError, EOFError) as exc:
        raise ConnectionError(f"{where} closed the connection before its greeting ({exc})") from None
    if greeting[:len(MAGIC)] != MAGIC:
        raise ClusterAuthError(_sentence(f"{where} is not a stagewise pipeline (it answered something else); "
                                         f"check --master-addr and --master-port."))
    ours = _new_key_share()
    theirs, nonce, packed = greeting[len(MAGIC):], ours.public_key().public_bytes_raw(), hello.pack()
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
    keys = _derive(ours, theirs, key, theirs, nonce, packed, dialler=True)
    if keys is None and SEAL_LINKS:
        raise ClusterAuthError(_sentence(f"{where} proved the cluster token but sent no valid key share."))
    sock.settimeout(None)
    return keys


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


class Gate:
    """A listener's door: each accepted connection proves the key in a thread of its own (a peer that
    stalls delays nobody), at most MAX_HANDSHAKES at once; `admit(sock, hello, peer, keys)` gets the ones
    that did, with the connection's keys."""

    def __init__(self, what: str, key: bytes,
                 admit: Callable[[socket.socket, Hello, tuple, LinkKeys | None], None]):
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
            hello, keys = serve_handshake(sock, self.key)
        except ClusterAuthError as exc:
            self.refusals.refused(peer, str(exc))
            return
        finally:
            self.slots.release()
        self.admit(sock, hello, peer, keys)


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


def _new_key_share() -> X25519PrivateKey:
    """A fresh ephemeral X25519 key (cryptography loads here, on a process's first link: ~9 MiB a
    one-process engine never needs)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    return X25519PrivateKey.generate()


def _derive(ours: X25519PrivateKey, theirs: bytes, key: bytes, listener_nonce: bytes, dialler_nonce: bytes,
            hello: bytes, dialler: bool) -> LinkKeys | None:
    """The connection's keys, from the ephemeral shared secret and the token's key. A listener that gets
    a key share that yields no secret (a low-order point: only a token holder could send it) refuses it."""
    if not SEAL_LINKS:
        return None
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    try:
        shared = ours.exchange(X25519PublicKey.from_public_bytes(theirs))
    except ValueError:
        if dialler:
            return None
        raise ClusterAuthError("the peer sent an invalid key share") from None
    okm = HKDF(hashes.SHA256(), 64, listener_nonce + dialler_nonce, KEYS_INFO + hello).derive(shared + key)
    to_listener, to_dialler = okm[:32], okm[32:]
    return LinkKeys(to_listener, to_dialler) if dialler else LinkKeys(to_dialler, to_listener)


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
