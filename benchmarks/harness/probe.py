"""Measures a simulated link from inside its nodes: round-trip time, TCP throughput and UDP frame
order. A standalone script run in a node: `probe.py serve PORT` (prints "ready") on one node,
`probe.py measure HOST PORT SECONDS` on another prints one JSON line:
{"rtt_ms": [...], "mbit_s": ..., "udp_sent": n, "udp_received": m, "udp_in_order": bool}.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time

UDP_COUNT = 2000


def _echo(conn: socket.socket) -> None:
    """Answers b"x" to each message that ends with it; the bulk data before it is only read."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(1 << 20):
            if data.endswith(b"x"):
                conn.sendall(b"x")


def _udp_sink(port: int) -> None:
    """Sends back, for each b"?" query, the sequence numbers received so far (as JSON)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    seen: list[int] = []
    while True:
        data, peer = sock.recvfrom(2048)
        if data == b"?":
            sock.sendto(json.dumps(seen).encode(), peer)
            seen = []
        else:
            seen.append(int.from_bytes(data[:4], "big"))


def serve(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port), reuse_port=True)
    threading.Thread(target=_udp_sink, args=(port,), daemon=True).start()
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def _round_trip(conn: socket.socket, payload: bytes = b"") -> None:
    conn.sendall(payload + b"x")
    if conn.recv(1) != b"x":
        raise RuntimeError("the probe server closed the connection")


def _udp_order(host: str, port: int) -> tuple[int, list[int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(5)
    for seq in range(UDP_COUNT):
        sock.sendto(seq.to_bytes(4, "big") + bytes(996), (host, port))
    time.sleep(0.5)       # the frames still held by the relays arrive
    sock.sendto(b"?", (host, port))
    return UDP_COUNT, json.loads(sock.recv(1 << 20))


def measure(host: str, port: int, seconds: float) -> dict:
    conn = socket.create_connection((host, port), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(20):
        start = time.perf_counter()
        _round_trip(conn)
        rtts.append((time.perf_counter() - start) * 1000)
    block, sent, start = bytes(1 << 16), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sent += conn.send(block)
    _round_trip(conn)
    mbit_s = sent * 8 / (time.perf_counter() - start) / 1e6
    total, got = _udp_order(host, port)
    return {"rtt_ms": rtts, "mbit_s": mbit_s, "udp_sent": total, "udp_received": len(got),
            "udp_in_order": got == sorted(got) and len(set(got)) == len(got)}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))), flush=True)
