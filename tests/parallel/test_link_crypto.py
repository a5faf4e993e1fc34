"""Cluster links are sealed (cluster/auth.py, cluster/transport.py): after the handshake every
frame travels as AES-256-GCM records under per-connection, per-direction keys with sequence-number
nonces. A relay between the two ends reads the wire: no plaintext crosses it, and a record it
changes, replays, reorders or reflects closes the link with one sentence. In one process, over
loopback TCP; the capture of a real pipeline's traffic is in test_link_crypto_capture.py."""
from __future__ import annotations

import queue
import socket
import struct
import threading
import time

import pytest
import torch

from stagewise.cluster import auth
from stagewise.cluster.auth import ANSWER_BYTES, MAC_BYTES, MAGIC, NONCE_BYTES, RING, Gate, Hello, key_of
from stagewise.cluster.store import StoreClient, StoreServer, dial
from stagewise.cluster.transport import MAGIC as FRAME_MAGIC
from stagewise.cluster.transport import RECORD, Link, LinkError, Sealer
from stagewise.executor.messages import Heartbeat, PlanMsg, recv_message, send_message
from stagewise.plan import NewRequestData, ScheduledSeq, StepPlan
from stagewise.request import SamplingParams

KEY = key_of("s3cret")
MARKER_IDS = [31337, 27182, 16180, 14142, 17320]       # a prompt whose JSON text we look for on the wire


class Relay:
    """A TCP man in the middle: forwards one connection's handshake as is, then record by record,
    through `hooks[direction](index, record) -> list of records to forward` ('up': dialler to
    listener, 'down': back). Keeps every byte it saw per direction."""

    def __init__(self, upstream: tuple, hooks: dict | None = None):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()
        self.upstream, self.hooks = upstream, hooks or {}
        self.seen = {"up": bytearray(), "down": bytearray()}
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.server.accept()
        listener = socket.create_connection(self.upstream)
        for direction, src, dst, handshake in (("up", client, listener, [ANSWER_BYTES]),
                                               ("down", listener, client, [len(MAGIC) + NONCE_BYTES, MAC_BYTES])):
            threading.Thread(target=self._pump, args=(direction, src, dst, handshake), daemon=True).start()

    def _pump(self, direction: str, src: socket.socket, dst: socket.socket, handshake: list[int]) -> None:
        hook = self.hooks.get(direction)
        try:
            for size in handshake:                 # each message of the handshake as it comes
                self._forward(direction, dst, self._exactly(src, size, direction))
            while hook is None:                    # as it comes (a plain link's frames are no records)
                chunk = src.recv(65536)
                if not chunk:
                    raise EOFError
                self.seen[direction] += chunk
                dst.sendall(chunk)
            index = 0
            while True:
                head = self._exactly(src, RECORD.size, direction)
                record = head + self._exactly(src, RECORD.unpack(head)[0], direction)
                for out in hook(index, record):
                    self._forward(direction, dst, out)
                index += 1
        except (OSError, EOFError):
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _forward(self, direction: str, dst: socket.socket, data: bytes) -> None:
        dst.sendall(data)

    def _exactly(self, sock: socket.socket, n: int, direction: str) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        self.seen[direction] += buf
        return bytes(buf)

    def close(self) -> None:
        self.server.close()


def _pair(hooks: dict | None = None) -> tuple[Link, Link, Relay]:
    """A dialler's link and the listener's, through a Relay; both proved KEY."""
    admitted: queue.SimpleQueue = queue.SimpleQueue()
    listener = socket.create_server(("127.0.0.1", 0))
    gate = Gate("the test listener", KEY, lambda sock, hello, peer, keys: admitted.put(Link(sock, "the dialler", keys)))
    threading.Thread(target=gate.serve, args=(listener,), daemon=True).start()
    relay = Relay(listener.getsockname(), hooks)
    sock, keys = dial(*relay.address, KEY, Hello(RING, 1, 2, 7), "the listener", time.monotonic() + 10, 10)
    dialler = Link(sock, "the listener", keys)
    there = admitted.get(timeout=10)
    listener.close()
    return dialler, there, relay


def _plan_msg() -> PlanMsg:
    proxy = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 0.5         # recognizable bytes
    plan = StepPlan(3, [ScheduledSeq("req-secret", 0, 5, True, [0])],
                    [NewRequestData("req-secret", MARKER_IDS, 5, SamplingParams(), [0])])
    return PlanMsg(plan, {"hidden_states": proxy})


def _wire_has_plaintext(wire: bytes, msg: PlanMsg) -> list[str]:
    found = []
    for name, needle in (("the frame magic", FRAME_MAGIC), ("the message type", b"PlanMsg"),
                         ("the prompt's ids", ",".join(map(str, MARKER_IDS)).encode()),
                         ("the request id", b"req-secret"),
                         ("the activations", msg.proxy["hidden_states"][2:4].numpy().tobytes())):
        if needle in wire:
            found.append(name)
    return found


@pytest.mark.parametrize("sealed", [True, False])
def test_the_wire_carries_no_plaintext(monkeypatch, sealed):
    """Sealed, nothing of a plan crosses the relay readable; the control (sealing off, as the benchmark
    runs it) shows that the relay does see every one of those markers in a plain link."""
    monkeypatch.setattr(auth, "SEAL_LINKS", sealed)
    dialler, there, relay = _pair()
    msg = _plan_msg()
    for _ in range(2):
        send_message(dialler, msg).wait(5)
        got = recv_message(there, 5)
        assert got.plan.new_reqs[0].token_ids == MARKER_IDS
        assert torch.equal(got.proxy["hidden_states"], msg.proxy["hidden_states"])
    send_message(there, msg).wait(5)
    assert recv_message(dialler, 5).plan.plan_id == 3
    up, down = bytes(relay.seen["up"]), bytes(relay.seen["down"])
    if sealed:
        assert _wire_has_plaintext(up, msg) == [] and _wire_has_plaintext(down, msg) == []
    else:
        assert len(_wire_has_plaintext(up, msg)) == 5 and len(_wire_has_plaintext(down, msg)) == 5
    for link in (dialler, there):
        link.close()
    relay.close()


def test_two_records_of_one_message_never_repeat_a_key_stream():
    """The same message sent twice on one link, and on a second link with the same token, is sealed
    to different bytes each time (sequence nonces; fresh per-connection keys)."""
    sent = []
    for _ in range(2):
        dialler, there, relay = _pair()
        for _ in range(2):
            send_message(dialler, Heartbeat()).wait(5)
            recv_message(there, 5)
        up = bytes(relay.seen["up"][ANSWER_BYTES:])
        size = RECORD.size + RECORD.unpack(up[:4])[0]
        sent += [up[:size], up[size:2 * size]]
        dialler.close(), there.close(), relay.close()
    assert len(set(sent)) == 4


def _flip(index: int):
    def hook(i, record):
        if i != index:
            return [record]
        changed = bytearray(record)
        changed[RECORD.size + 3] ^= 0x01                   # one bit of the ciphertext
        return [bytes(changed)]
    return hook


def _replay(index: int):
    return lambda i, record: [record, record] if i == index else [record]


def _swap():
    held = []

    def hook(i, record):
        if i == 0:
            held.append(record)
            return []
        return [record, *held] if i == 1 else [record]
    return hook


def _length(size: int):
    return lambda i, record: [struct.pack("!I", size) + record[4:]] if i == 0 else [record]


@pytest.mark.parametrize("hook, good, why", [
    (_flip(1), 1, "a record that fails its integrity check"),
    (_replay(0), 1, "a record that fails its integrity check"),
    (_swap(), 0, "a record that fails its integrity check"),
    (_length(1 << 30), 0, "a record of 1073741824 bytes, which no sealed link sends"),
    (_length(5), 0, "a record of 5 bytes, which no sealed link sends"),
])
def test_a_changed_replayed_or_reordered_record_closes_the_link(hook, good, why):
    dialler, there, relay = _pair({"up": hook})
    for beat in range(3):
        send_message(dialler, PlanMsg(StepPlan(beat, [], []))).wait(5)
    for step in range(good):
        assert recv_message(there, 5).plan.plan_id == step
    with pytest.raises(LinkError, match=f"^the dialler sent {why}"):
        recv_message(there, 5)
    with pytest.raises(LinkError, match="closed"):        # nothing more is read from that link
        recv_message(there, 5)
    for link in (dialler, there):
        link.close()
    relay.close()


def test_a_reflected_record_fails_to_open():
    """Records the dialler sent, sent back to it: the other direction's key does not open them."""
    dialler, there, relay = _pair()
    send_message(dialler, Heartbeat()).wait(5)
    recv_message(there, 5)
    up = bytes(relay.seen["up"][ANSWER_BYTES:])
    reflected = socket.socket(fileno=socket.dup(there.sock.fileno()))    # the listener's socket
    reflected.sendall(up)
    with pytest.raises(LinkError, match="the listener sent a record that fails its integrity check"):
        recv_message(dialler, 5)
    reflected.close()
    for link in (dialler, there):
        link.close()
    relay.close()


def test_keys_are_per_connection_and_per_direction():
    pairs = []
    for _ in range(2):
        got: queue.SimpleQueue = queue.SimpleQueue()
        listener = socket.create_server(("127.0.0.1", 0))
        gate = Gate("the test listener", KEY, lambda sock, hello, peer, keys, got=got: got.put((sock, keys)))
        threading.Thread(target=gate.serve, args=(listener,), daemon=True).start()
        sock, theirs = dial(*listener.getsockname(), KEY, Hello(RING, 1, 2, 7), "x", time.monotonic() + 10, 10)
        other, ours = got.get(timeout=10)
        assert theirs.send == ours.recv and theirs.recv == ours.send and ours.send != ours.recv
        assert "s3cret" not in repr(ours) and ours.send.hex() not in repr(ours)
        pairs.append(ours)
        for s in (sock, other, listener):
            s.close()
    assert pairs[0].send != pairs[1].send and pairs[0].recv != pairs[1].recv
    a = Sealer(pairs[0].send)
    with pytest.raises(LinkError, match="fails its integrity check"):
        Sealer(pairs[0].recv).open(*a.seal([b"hello"]), "x")      # sealed one way, opened the other


def test_store_requests_cross_sealed():
    """The rendezvous store's requests and answers are sealed too."""
    store = StoreServer("127.0.0.1", 0, KEY)
    relay = Relay(store.listener.getsockname())
    client = StoreClient(*relay.address, KEY, deadline=time.monotonic() + 10, timeout_s=10)
    client.set("stagewise/secret-key", "secret-value")
    assert client.get("stagewise/secret-key") == b"secret-value" and store.get("stagewise/secret-key")
    wire = bytes(relay.seen["up"] + relay.seen["down"])
    assert b"secret" not in wire and b'"set"' not in wire
    client.close(), relay.close(), store.close()
