"""Graceful shutdown. The first SIGINT/SIGTERM starts a drain: the server keeps listening, but
/health and new requests answer 503 while open requests run on, up to the graceful timeout.
At the deadline every request still open is cut with an error (streams get an error event and
`data: [DONE]`, others a 503), then uvicorn stops and the lifespan hook stops the engine.
A second signal stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from ..core.client import EngineClient

log = logging.getLogger("stagewise.server")
FLUSH_S = 2.0          # after the cut: time for the last events to reach their clients
POLL_S = 0.05
CUT_MESSAGE = "The server shut down before this request finished (graceful-shutdown deadline); retry it."


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: EngineClient, graceful_timeout_s: float):
        super().__init__(config)
        self.engine, self.graceful_timeout_s = engine, graceful_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        # NOTE: runs as a signal handler, so it only schedules the drain. Not recording the signal
        # keeps uvicorn from re-raising it after a graceful exit: a drained server exits 0.
        if self._draining or self._loop is None:      # a second signal, or one during start-up: stop now
            self.force_exit = self._draining
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        engine = self.engine
        engine.begin_drain()
        log.info("shutting down: %d open request(s) get up to %.1f s to finish", engine.num_open,
                 self.graceful_timeout_s)
        await _wait_until(lambda: engine.num_open == 0, self.graceful_timeout_s)
        if engine.num_open:
            log.warning("graceful-shutdown deadline: cutting %d open request(s)", engine.num_open)
            engine.cut_open(CUT_MESSAGE)
            await _wait_until(lambda: engine.num_open == 0, FLUSH_S)
        self.should_exit = True


async def _wait_until(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
