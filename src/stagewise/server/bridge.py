"""AsyncEngine: runs `Engine.step()` in one background thread and streams each request's
outputs to the asyncio side through its own queue (via `loop.call_soon_threadsafe`).

It owns request ids, aborts on disconnect, engine death (fail everyone, report unhealthy),
the shutdown drain (refuse new requests, cut the open ones at the deadline) and shutdown; it
does not know HTTP. `snapshot` is the engine's latest `stats()`, published
by the engine thread so scrapers never touch the scheduler from another thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..errors import EngineDeadError
from ..request import CompletionOutput, RequestOutput, SamplingParams

log = logging.getLogger("stagewise.server")
IDLE_PUBLISH_S = 1.0          # refresh the stats snapshot this often while idle
NO_PROGRESS_WAIT_S = 0.005    # nothing schedulable but work pending: wait instead of spinning
ENGINE_FAULT = "The engine failed with an internal error (the server logged the details); restart the server."


@dataclass
class PromptInput:
    """One engine submission: exactly one of ids or embeddings, and its length in positions."""
    prompt_token_ids: list[int] | None = None
    input_embeds: Any = None                 # torch.Tensor [T, H]
    text: str | None = None                  # the prompt as the client wrote it (echoed back), if text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) if self.input_embeds is None else int(self.input_embeds.shape[0])


class Submission:
    """The requests of one HTTP call (prompts x n), sharing one queue."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue
        self.index: dict[str, int] = {}
        self.pending: set[str] = set()

    def add(self, rid: str) -> None:
        self.index[rid] = len(self.index)
        self.pending.add(rid)

    def __len__(self) -> int:
        return len(self.index)


class ServerUnavailable(RuntimeError):
    """The engine died or the server is shutting down; new requests get HTTP 503."""


class AsyncEngine:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.dead: str | None = None
        self.draining = False                              # shutting down: no new requests
        self.stopping = False
        self._stopped = False
        self.snapshot: dict = engine.stats()
        self._lock = threading.Lock()                      # guards _streams and dead
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}   # id -> (queue, prompt length)
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
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
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0f s; shutting the engine down anyway", timeout_s)
        self._fail_all("The request was aborted because the server is shutting down; retry later.", "abort")
        self.engine.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and not self.draining and not self.stopping and self._thread.is_alive()

    # the shutdown drain (event loop thread)
    def begin_drain(self) -> None:
        """Refuse new requests (503) and report unhealthy; open requests run on."""
        self.draining = True

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def cut_open(self, why: str) -> None:
        """End every open request now with `why` (an abort), and stop computing them."""
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.engine.abort(rid)
        self._wake.set()
        self._fail_all(why, "abort")

    # requests (event loop thread)
    def submit(self, inputs: list[PromptInput], params: list[SamplingParams]) -> "Submission":
        """Queue every input, all or none: raises ValueError (bad input) or ServerUnavailable.
        The caller must `stream()` the submission or `release()` it."""
        sub = Submission(asyncio.Queue())
        with self._lock:
            if self.dead or self.stopping or self.draining:
                raise ServerUnavailable(self.dead or "The server is shutting down; retry later.")
            try:
                for inp, p in zip(inputs, params):
                    rid = f"req-{uuid.uuid4().hex}"
                    self._streams[rid] = (sub.queue, inp.num_tokens)
                    sub.add(rid)
                    self.engine.add_request(params=p, prompt_token_ids=inp.prompt_token_ids,
                                            input_embeds=inp.input_embeds, request_id=rid)
            except BaseException:
                self._release_locked(sub)
                raise
        self._wake.set()
        return sub

    async def stream(self, sub: "Submission") -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (index, cumulative output) until every request finishes. Leaving early (client gone,
        cancellation) aborts the unfinished ones, which frees their KV blocks."""
        try:
            while sub.pending:
                latest = {}
                out = await sub.queue.get()
                latest[out.request_id] = out
                while not sub.queue.empty():       # outputs are cumulative: keep only the newest
                    out = sub.queue.get_nowait()
                    latest[out.request_id] = out
                for rid, out in latest.items():
                    if rid not in sub.pending:     # a late duplicate final (engine death, shutdown)
                        continue
                    if out.finished:
                        sub.pending.discard(rid)
                    yield sub.index[rid], out
        finally:
            self.release(sub)

    def release(self, sub: "Submission") -> None:
        """Abort what is unfinished and forget the submission; safe to call more than once."""
        with self._lock:
            self._release_locked(sub)
        self._wake.set()

    def _release_locked(self, sub: "Submission") -> None:
        for rid in sub.pending:
            self.engine.abort(rid)
        sub.pending.clear()
        for rid in sub.index:
            self._streams.pop(rid, None)

    def num_prompt_tokens(self, rid: str) -> int:
        entry = self._streams.get(rid)
        return entry[1] if entry else 0

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
            self._wake.clear()
            if self.stopping:
                return self._drain_for_stop()
            if not self.engine.has_unfinished():
                # NOTE: an idle engine never calls the executor, so a stage that died meanwhile would
                # only show at the next request; the executor's monitor flags it, check it here.
                why = getattr(self.engine.executor, "dead", None)
                if why:
                    self._die(str(why), [])
                    self.engine.shutdown()
                    return
                if time.monotonic() - last_publish > IDLE_PUBLISH_S:
                    self._publish()
                    last_publish = time.monotonic()
                self._wake.wait(IDLE_PUBLISH_S)
                continue
            progressed = self._step()
            if progressed is None:
                return
            self._publish()
            last_publish = time.monotonic()
            if not progressed:
                self._wake.wait(NO_PROGRESS_WAIT_S)

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
        for rid in ids:
            self.engine.abort(rid)
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
        if not outputs:
            return
        if self.metrics is not None:
            now = time.monotonic()
            try:
                for out in outputs:
                    if out.finished:
                        self.metrics.observe_finished(out, self.num_prompt_tokens(out.request_id), now)
            except Exception:                       # metrics must never cost a client its answer
                log.exception("recording request metrics failed")
        self._post(outputs)

    def _post(self, outputs: list[RequestOutput]) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:                        # loop closed during shutdown
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                entry[0].put_nowait(out)

    def _die(self, why: str, outputs) -> None:
        log.error("engine is dead: %s", why)
        with self._lock:
            self.dead = why
        self._deliver(list(outputs))
        self._fail_all(why, "error")

    def _fail_all(self, why: str, reason: str) -> None:
        """Finish every stream still open with `reason` (after the real outputs already posted)."""
        with self._lock:
            ids = list(self._streams)
        self._post([_final_output(rid, reason, why) for rid in ids])


def _final_output(rid: str, reason: str, message: str) -> RequestOutput:
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", [], reason, None, message)], finished=True)
