"""The driver's heartbeat watch (executor/liveness.py) over real links, without stage processes: a
stage whose beats stop while its link stays open is declared lost about --heartbeat-timeout-s later,
and only that one; a stage whose link closes is left to the death checks (it is not called silent)."""
from __future__ import annotations

import socket
import threading
import time

from stagewise.cluster.transport import Link
from stagewise.executor.liveness import Watch, start_beating
from stagewise.executor.messages import StageAlive, send_message

TIMEOUT_S = 1.0


def _links() -> tuple[Link, Link]:
    """(the stage's end, the driver's end) of a loopback TCP link."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Link(a, "the driver"), Link(b, "stage")


def _watch(controls: list[Link]) -> tuple[Watch, list, threading.Event]:
    lost, done = [], threading.Event()

    def on_lost(stage: int, silent_s: float) -> None:
        lost.append((stage, silent_s, time.monotonic()))
        done.set()
    return Watch(controls, TIMEOUT_S, on_lost), lost, done


def test_a_silent_stage_is_lost_and_a_beating_one_is_not():
    (beating, beating_d), (silent, silent_d) = _links(), _links()
    start_beating(beating, 0, TIMEOUT_S)
    for n in range(3):
        send_message(silent, StageAlive(1, n)).wait(5)
    stopped_at = time.monotonic()
    watch, lost, done = _watch([beating_d, silent_d])
    assert done.wait(10)
    (stage, silent_s, at), = lost
    assert stage == 1 and TIMEOUT_S < silent_s < 3 * TIMEOUT_S
    assert TIMEOUT_S < at - stopped_at < 5 * TIMEOUT_S
    watch.stop()
    for link in (beating, beating_d, silent, silent_d):
        link.close()


def test_a_closed_control_link_is_not_called_silent():
    stage_end, driver_end = _links()
    send_message(stage_end, StageAlive(0, 0)).wait(5)
    stage_end.close()                   # the process died: its exit status, or a ring link, says so
    watch, lost, done = _watch([driver_end])
    assert not done.wait(3 * TIMEOUT_S) and not lost
    watch.stop()
    driver_end.close()
