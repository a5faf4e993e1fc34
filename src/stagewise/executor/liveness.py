"""Heartbeats: a stage that stops answering is found in seconds, not after --dist-timeout-s.

Every stage process sends StageAlive on its control link from a thread of its own, BEATS_PER_TIMEOUT
times per --heartbeat-timeout-s; the driver's watch thread declares a stage lost once nothing came
from it for that long. A beat stops when the process is stopped (SIGSTOP), frozen, or cut off from
the network; a stage busy in a long computation keeps beating (its main thread releases the GIL),
so --dist-timeout-s still bounds one plan. A control link that closes is left to the other checks
(a dead process is reported with its exit status, a closed ring link names the stage behind it).
"""
from __future__ import annotations

import logging
import select
import threading
import time
from typing import Callable

from ..cluster.transport import Link
from .messages import CONTROL, StageAlive, recv_message, send_message

log = logging.getLogger("stagewise.executor")
BEATS_PER_TIMEOUT = 5


def beat_interval_s(timeout_s: float) -> float:
    return timeout_s / BEATS_PER_TIMEOUT


def start_beating(link: Link, stage: int, timeout_s: float) -> None:
    """StageAlive on `link` every beat until the link fails (the process ends with its stage)."""
    def beat() -> None:
        n = 0
        while True:
            try:
                send_message(link, StageAlive(stage, n)).wait(timeout_s)
            except (OSError, TimeoutError):
                return
            n += 1
            time.sleep(beat_interval_s(timeout_s))
    threading.Thread(target=beat, daemon=True, name="stagewise-beat").start()


class Watch:
    """The driver's side: reads every stage's beats; `on_lost(stage, silent_s)` once one falls silent."""

    def __init__(self, controls: list[Link], timeout_s: float, on_lost: Callable[[int, float], None]):
        self.links = {link: stage for stage, link in enumerate(controls)}
        self.timeout_s, self.on_lost = timeout_s, on_lost
        self.stopped = False
        threading.Thread(target=self._run, daemon=True, name="stagewise-liveness").start()

    def stop(self) -> None:
        self.stopped = True

    def _run(self) -> None:
        heard = {stage: time.monotonic() for stage in self.links.values()}
        while not self.stopped and self.links:
            readable, _, _ = select.select(list(self.links), [], [], beat_interval_s(self.timeout_s))
            for link in readable:
                self._drain(link, heard)
            # NOTE: judged only after draining what arrived: a driver that was itself descheduled
            # for a while finds the beats waiting and blames nobody
            now = time.monotonic()
            for stage, at in heard.items():
                if stage in self.links.values() and now - at > self.timeout_s and not self.stopped:
                    self.stopped = True
                    self.on_lost(stage, now - at)
                    return

    def _drain(self, link: Link, heard: dict[int, float]) -> None:
        stage = self.links[link]
        try:
            while link.readable():
                recv_message(link, self.timeout_s, CONTROL)
                heard[stage] = time.monotonic()
        except Exception as exc:  # noqa: BLE001  (closed or broken: a death the other checks report)
            log.debug("stopped watching stage %d's heartbeats: %s", stage, exc)
            del self.links[link]
