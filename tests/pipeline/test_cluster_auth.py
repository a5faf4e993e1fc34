"""Cluster links are authenticated (cluster/auth.py): the rendezvous store and every stage link
refuse a peer without the cluster token before they interpret a byte it sends, a dialler refuses
a listener that cannot prove the token, and links of another pipeline attempt are refused too.
In one process, over loopback TCP (the two-host runs are in test_multinode.py)."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from stagewise.cluster import auth
from stagewise.cluster.auth import MAGIC, NONCE_BYTES, RING, Hello, dial_handshake, key_of
from stagewise.cluster.links import open_links
from stagewise.cluster.store import StoreClient, StoreServer
from stagewise.errors import ClusterAuthError
from stagewise.executor.messages import CONTROL as CONTROL_MSGS
from stagewise.executor.messages import Heartbeat, StageAlive, recv_message, send_message

KEY = key_of("s3cret")


def _read_all(sock: socket.socket) -> bytes:
    """What the peer sends until it closes (a reset, from a peer closing with our bytes unread, too)."""
    out = b""
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _logged(caplog, text: str, timeout_s: float = 5.0) -> None:
    """`text` in the log (a listener logs a refusal from its own thread, just after it closed the socket)."""
    deadline = time.monotonic() + timeout_s
    while text not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.01)


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, KEY)
    yield server
    server.close()


def _port(server: StoreServer) -> int:
    return server.listener.getsockname()[1]


def test_store_answers_its_token_holders(store):
    client = StoreClient("127.0.0.1", _port(store), KEY, deadline=0, timeout_s=5)
    assert client.add("n", 2) == 2 and store.add("n", 1) == 3
    client.set("k", "v")
    assert client.get("k") == b"v" and client.check(["k", "n"]) and not client.check(["nope"])
    with pytest.raises(KeyError):
        client.get("nope")
    client.close()


def test_store_refuses_a_raw_socket_before_reading_its_request(store, caplog):
    """A peer that sends a store request (or anything) instead of the handshake's answer gets nothing
    back, the connection is closed, and the request never ran."""
    request = json.dumps(["set", "owned", "1"]).encode()
    with caplog.at_level(logging.WARNING, logger="stagewise.executor"):
        for junk in (len(request).to_bytes(4, "big") + request + b"\0" * 77, b"\0" * 77):
            with socket.create_connection(("127.0.0.1", _port(store)), timeout=5) as raw:
                greeting = raw.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL)
                assert greeting.startswith(MAGIC)          # the listener speaks first, and only that
                raw.sendall(junk)
                assert _read_all(raw) == b""               # closed without an answer
        assert not store.check(["owned"])
        _logged(caplog, "refused a connection from 127.0.0.1: the peer did not prove the cluster token")
    assert caplog.text.count("refused a connection") == 1       # rate-limited: a scan cannot flood the log


def test_a_flood_of_silent_connections_holds_a_bounded_number_of_handshakes(monkeypatch):
    monkeypatch.setattr(auth, "MAX_HANDSHAKES", 2)
    server = StoreServer("127.0.0.1", 0, KEY)
    silent = [socket.create_connection(("127.0.0.1", _port(server)), timeout=5) for _ in range(2)]
    for sock in silent:
        assert sock.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL).startswith(MAGIC)
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=5) as third:
        assert _read_all(third) == b""                 # closed at once: no thread, no greeting
    for sock in silent:
        sock.close()
    client = StoreClient("127.0.0.1", _port(server), KEY, deadline=time.monotonic() + 30, timeout_s=30)
    assert client.add("n", 1) == 1                      # a token holder gets in once a slot is free
    client.close()
    server.close()


def test_a_node_with_another_token_cannot_join(store):
    with pytest.raises(ClusterAuthError, match=r"^The rendezvous at 127\.0\.0\.1:\d+ refused this node: its cluster "
                                               r"token differs; give every node the same --cluster-token"):
        StoreClient("127.0.0.1", _port(store), key_of("guess"), deadline=0, timeout_s=5)
    with pytest.raises(ClusterAuthError, match="refused this node"):
        StoreClient("127.0.0.1", _port(store), key_of(None), deadline=0, timeout_s=5)     # no token at all


def test_a_dialler_refuses_a_listener_without_the_token():
    """An impostor that answers like a stagewise listener but cannot prove the token."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        def impostor():
            conn, _ = fake.accept()
            with conn:
                conn.sendall(MAGIC + b"\1" * NONCE_BYTES)
                conn.recv(4096)
                conn.sendall(b"\0" * 32)
        threading.Thread(target=impostor, daemon=True).start()
        with socket.create_connection(fake.getsockname(), timeout=5) as sock:
            with pytest.raises(ClusterAuthError, match="did not prove the cluster token"):
                dial_handshake(sock, KEY, Hello(RING, 1, 2, 0), "stage 1 at 127.0.0.1:1")


def test_ring_and_control_links_open_and_refuse_strangers(store, caplog):
    """Three ranks (the driver and two stages) open their links through the store; meanwhile a raw
    socket and a token holder claiming a link of another attempt dial the driver's listener and are
    refused; the links carry messages."""
    world, found = 3, {}

    def rank(r):
        found[r] = open_links(r, world, store, "stagewise/t", "127.0.0.1", KEY, timeout_s=30)

    def strangers():
        while not store.check(["stagewise/t/link0"]):
            pass
        host, port = json.loads(store.get("stagewise/t/link0"))
        with socket.create_connection((host, port), timeout=5) as raw:
            raw.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL)
            raw.sendall(b"\0" * 77)
            found["raw"] = _read_all(raw)
        with socket.create_connection((host, port), timeout=5) as other:
            dial_handshake(other, KEY, Hello(RING, 2, 0, session=12345), "the driver")    # the token holds...
            found["other"] = _read_all(other)         # ...but it is a link of another attempt: closed

    with caplog.at_level(logging.WARNING, logger="stagewise.executor"):
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        threads.append(threading.Thread(target=strangers))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(k for k in found if isinstance(k, int)) == [0, 1, 2]
    assert found["raw"] == b"" and found["other"] == b""
    driver, first, last = found[0], found[1], found[2]
    send_message(driver.next, Heartbeat()).wait(5)
    assert isinstance(recv_message(first.prev, 5), Heartbeat)
    send_message(first.next, Heartbeat()).wait(5)
    assert isinstance(recv_message(last.prev, 5), Heartbeat)
    send_message(last.next, Heartbeat()).wait(5)
    assert isinstance(recv_message(driver.prev, 5), Heartbeat)
    for stage, links in enumerate((first, last)):
        assert links.control is not None
        send_message(links.control, StageAlive(stage, 0)).wait(5)
        assert recv_message(driver.controls[stage], 5, CONTROL_MSGS) == StageAlive(stage, 0)
    _logged(caplog, "the driver's link listener refused a connection from 127.0.0.1: the peer did not prove")
    for links in found.values():
        if not isinstance(links, bytes):
            links.close()
