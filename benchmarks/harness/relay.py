"""The delaying link of a simulated node: forwards Ethernet frames between a TAP device inside the
node's namespace and one on the switch's bridge, holding each frame the node sends for the delay.

A standalone script (no package imports) run by cluster.py as `python relay.py NODE_NS SWITCH_NS
NODE_TAP SWITCH_TAP DELAY_MS`; stdin takes new delays ("12.5\n") and its end stops the relay, so a
relay never outlives the harness that started it.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import select
import struct
import sys
import time
from collections import deque

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
PR_SET_TIMERSLACK = 29
FRAME_MAX = 65536
BATCH = 64             # frames read from one device per wake-up, so one direction cannot starve the other


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)


def open_tap(netns: str, name: str) -> int:
    """An fd on the existing TAP `name` in namespace `netns`; the fd stays bound to that namespace's
    device after this process goes back to its own namespace."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        _setns(f"/run/netns/{netns}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        return fd
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(home, CLONE_NEWNET)
        os.close(home)


def _drain(fd: int) -> list[bytes]:
    frames = []
    for _ in range(BATCH):
        try:
            frames.append(os.read(fd, FRAME_MAX))
        except BlockingIOError:
            break
    return frames


def _send(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:
        pass    # the other side is down (a cut link) or full: the frame is lost, as on a wire


class Relay:
    def __init__(self, node_fd: int, switch_fd: int, delay_s: float) -> None:
        self.node_fd, self.switch_fd, self.delay_s = node_fd, switch_fd, delay_s
        # A FIFO, not a heap: frames leave in the order they came even when the delay shrinks.
        self.held: deque[tuple[float, bytes]] = deque()

    def control(self, data: bytes) -> None:
        lines = data.decode().split()
        if lines:
            self.delay_s = float(lines[-1]) / 1000.0

    def step(self, ready: list[int]) -> None:
        now = time.monotonic()
        if self.node_fd in ready:
            self.held.extend((now + self.delay_s, f) for f in _drain(self.node_fd))
        if self.switch_fd in ready:
            for frame in _drain(self.switch_fd):
                _send(self.node_fd, frame)
        while self.held and self.held[0][0] <= now:
            _send(self.switch_fd, self.held.popleft()[1])

    def timeout_s(self) -> float:
        return 1.0 if not self.held else max(0.0, self.held[0][0] - time.monotonic())


def serve(relay: Relay) -> None:
    fds = [relay.node_fd, relay.switch_fd, 0]
    while True:
        # select, not poll: its timeout has microseconds, poll's whole milliseconds.
        ready, _, _ = select.select(fds, [], [], relay.timeout_s())
        if 0 in ready:
            data = os.read(0, 4096)
            if not data:
                return          # the harness is gone (or closed the link)
            relay.control(data)
        relay.step(ready)


def _prompt() -> None:
    """Wake on time: timer slack of 1 ns (not 50 us) and a higher priority than the nodes' work,
    whose CPU time a busy benchmark would otherwise take from the link."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass    # not allowed: the delay is then only as exact as the scheduler makes it


def main(argv: list[str]) -> None:
    node_ns, switch_ns, node_tap, switch_tap, delay_ms = argv
    _prompt()
    relay = Relay(open_tap(node_ns, node_tap), open_tap(switch_ns, switch_tap), float(delay_ms) / 1000.0)
    print("ready", flush=True)
    serve(relay)


if __name__ == "__main__":
    main(sys.argv[1:])
