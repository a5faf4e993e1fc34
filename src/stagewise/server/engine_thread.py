"""ThreadEngine: the engine loop in a background thread of the server process, outputs posted to
the event loop (`loop.call_soon_threadsafe`). The HTTP side and the engine share one GIL; the
default layout is `ProcessEngine`. This one serves engines that must live in this process (tests
with scripted engines) and the before/after comparison of `benchmarks/serving_overhead.py`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..errors import EngineDeadError
from ..request import RequestOutput
from .bridge import (ENGINE_FAULT, IDLE_PUBLISH_S, NO_PROGRESS_WAIT_S, SHUTTING_DOWN, AsyncEngine, EngineInfo,
                     engine_facts, idle_stage_death)

log = logging.getLogger("stagewise.server")


class ThreadEngine(AsyncEngine):
    def __init__(self, engine, metrics=None):
        super().__init__(EngineInfo(tok=engine.tok, **engine_facts(engine)), engine.stats(), metrics)
        self.engine = engine
        self._stopped = False
        self._wake_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagewise-engine", daemon=True)

    # lifecycle (event loop thread)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is still running, let the engine thread finish, then stop the engine (once)."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping = True
        self._wake_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0f s; shutting the engine down anyway", timeout_s)
        self._fail_all(SHUTTING_DOWN, "abort")
        self.engine.shutdown()

    def _engine_alive(self) -> bool:
        return self._thread.is_alive()

    def _add(self, items) -> None:
        for rid, inp, p in items:
            self.engine.add_request(params=p, prompt_token_ids=inp.prompt_token_ids, input_embeds=inp.input_embeds,
                                    request_id=rid)

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort(rid)

    def _wake(self) -> None:
        self._wake_event.set()

    # engine thread
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException:                      # never let the engine thread die silently
            log.exception("engine thread failed")
            self._die(ENGINE_FAULT, [])

    def _loop_forever(self) -> None:
        last_publish = 0.0
        while True:
            self._wake_event.clear()
            if self.stopping:
                return self._drain_for_stop()
            if not self.engine.has_unfinished():
                why = idle_stage_death(self.engine)
                if why:
                    self._die(why, [])
                    self.engine.shutdown()
                    return
                if time.monotonic() - last_publish > IDLE_PUBLISH_S:
                    self._publish()
                    last_publish = time.monotonic()
                self._wake_event.wait(IDLE_PUBLISH_S)
                continue
            progressed = self._step()
            if progressed is None:
                return
            self._publish()
            last_publish = time.monotonic()
            if not progressed:
                self._wake_event.wait(NO_PROGRESS_WAIT_S)

    def _step(self) -> bool | None:
        """One engine step; True if it did work, None if the engine died."""
        plan_id = self.engine.scheduler.next_plan_id
        try:
            outputs = self.engine.step()
        except EngineDeadError as exc:
            self._die(str(exc), exc.outputs)
            return None
        except Exception:                          # a bug, not a request problem: stop serving loudly
            log.exception("engine step failed")
            self._die(ENGINE_FAULT, [])
            self.engine.shutdown()                 # free the stage processes now, not at server exit
            return None
        self._deliver(outputs)
        return bool(outputs) or self.engine.scheduler.next_plan_id != plan_id

    def _drain_for_stop(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            ids = list(self._streams)
        self._abort(ids)
        deadline = time.monotonic() + timeout_s
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            if self._step() is None:
                return
            self._publish()

    def _publish(self) -> None:
        try:
            self.snapshot = self.engine.stats()
        except Exception:                           # stats must never take the loop down
            log.exception("engine.stats() failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._observe(outputs, time.monotonic())
            self._post(outputs)
