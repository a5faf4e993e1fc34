"""AsyncEngine: the server's side of the engine, whatever process runs it. It owns request ids,
each HTTP call's output queue, aborts on disconnect, engine death (fail everyone, report
unhealthy), the shutdown drain (refuse new requests, cut the open ones at the deadline) and the
facts the server reads at start-up (`EngineInfo`); it does not know HTTP.

Two layouts implement the engine side: `ProcessEngine` (engine_process.py, the default: the
engine loop in its own process) and `ThreadEngine` (engine_thread.py: in a thread of this one).
Both deliver cumulative `RequestOutput`s to `_dispatch` on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..request import CompletionOutput, RequestOutput, SamplingParams
from .errors import ServerUnavailable

log = logging.getLogger("stagewise.server")
IDLE_PUBLISH_S = 1.0          # engine loops refresh the stats snapshot this often while idle
NO_PROGRESS_WAIT_S = 0.005    # nothing schedulable but work pending: wait instead of spinning
ENGINE_FAULT = "The engine failed with an internal error (the server logged the details); restart the server."
SHUTTING_DOWN = "The request was aborted because the server is shutting down; retry later."


@dataclass
class PromptInput:
    """One engine submission: exactly one of ids or embeddings, and its length in positions."""
    prompt_token_ids: list[int] | None = None
    input_embeds: Any = None                 # torch.Tensor [T, H]
    text: str | None = None                  # the prompt as the client wrote it (echoed back), if text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) if self.input_embeds is None else int(self.input_embeds.shape[0])


@dataclass
class EngineInfo:
    """What the server reads about the engine at start-up."""
    tok: Any                                 # engine.inputs.Tokenizer (or anything with its methods)
    max_model_len: int
    kv_capacity_tokens: int                  # what one request could ever hold (block 0 is reserved)
    model_dir: str
    config_model: str | None                 # the model as configured (a path or a name), an alias
    vocab_size: int


def engine_facts(engine) -> dict:
    """EngineInfo's fields but the tokenizer, from an engine object (the real `Engine` or one with
    its surface); plain values, so they can cross processes."""
    blocks = int(engine.stats().get("num_kv_blocks", 0)) or int(engine.executor.num_blocks)
    return {"max_model_len": int(engine.max_model_len), "kv_capacity_tokens": (blocks - 1) * int(engine.config.block_size),
            "model_dir": str(engine.model_dir), "config_model": engine.config.model,
            "vocab_size": int(engine.tok.vocab_size)}


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


class AsyncEngine:
    """The layout-independent part; subclasses implement `_add`, `_abort`, `_wake`, `start`, `stop`
    and `_engine_alive`, and hand outputs to `_post` (any thread) or `_dispatch` (event loop)."""

    def __init__(self, info: EngineInfo, snapshot: dict, metrics=None):
        self.info = info
        self.metrics = metrics
        self.dead: str | None = None
        self.draining = False                              # shutting down: no new requests
        self.stopping = False
        self.snapshot: dict = snapshot                     # the engine's latest stats()
        self._lock = threading.Lock()                      # guards _streams and dead
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}   # id -> (queue, prompt length)
        self._loop: asyncio.AbstractEventLoop | None = None

    # layout hooks
    def _add(self, items: list[tuple[str, PromptInput, SamplingParams]]) -> None:
        raise NotImplementedError

    def _abort(self, rids: list[str]) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        pass

    def _engine_alive(self) -> bool:
        raise NotImplementedError

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and not self.draining and not self.stopping and self._engine_alive()

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
        self._abort(ids)
        self._wake()
        self._fail_all(why, "abort")

    # requests (event loop thread)
    def submit(self, inputs: list[PromptInput], params: list[SamplingParams]) -> Submission:
        """Queue every input, all or none: raises ValueError (bad input) or ServerUnavailable.
        The caller must `stream()` the submission or `release()` it."""
        sub = Submission(asyncio.Queue())
        with self._lock:
            if self.dead or self.stopping or self.draining:
                raise ServerUnavailable(self.dead or "The server is shutting down; retry later.")
            items = []
            for inp, p in zip(inputs, params):
                rid = f"req-{uuid.uuid4().hex}"
                self._streams[rid] = (sub.queue, inp.num_tokens)
                sub.add(rid)
                items.append((rid, inp, p))
            try:
                self._add(items)
            except BaseException:
                self._release_locked(sub)
                raise
        self._wake()
        return sub

    async def stream(self, sub: Submission) -> AsyncIterator[tuple[int, RequestOutput]]:
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

    def release(self, sub: Submission) -> None:
        """Abort what is unfinished and forget the submission; safe to call more than once."""
        with self._lock:
            self._release_locked(sub)
        self._wake()

    def _release_locked(self, sub: Submission) -> None:
        if sub.pending:
            self._abort(list(sub.pending))
        sub.pending.clear()
        for rid in sub.index:
            self._streams.pop(rid, None)

    def num_prompt_tokens(self, rid: str) -> int:
        entry = self._streams.get(rid)
        return entry[1] if entry else 0

    # outputs
    def _observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Per-request metrics of the finished outputs; never costs a client its answer."""
        if self.metrics is None:
            return
        try:
            for out in outputs:
                if out.finished:
                    self.metrics.observe_finished(out, self.num_prompt_tokens(out.request_id), now)
        except Exception:
            log.exception("recording request metrics failed")

    def _post(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to the event loop from any thread."""
        if not outputs or self._loop is None or self._loop.is_closed():
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

    def _die(self, why: str, outputs: list[RequestOutput]) -> None:
        """The engine is gone: deliver its last outputs, then fail every open request with `why`."""
        log.error("engine is dead: %s", why)
        with self._lock:
            self.dead = why
        self._observe(outputs, time.monotonic())
        self._post(outputs)
        self._fail_all(why, "error")

    def _fail_all(self, why: str, reason: str) -> None:
        """Finish every stream still open with `reason` (after the real outputs already posted)."""
        with self._lock:
            ids = list(self._streams)
        self._post([final_output(rid, reason, why) for rid in ids])


def idle_stage_death(engine) -> str | None:
    """Why a stage died, if one did while the engine was idle.

    NOTE: an idle engine never calls the executor, so a stage that died meanwhile would only show
    at the next request; the executor's monitor flags it, and the engine loops check it here."""
    why = getattr(engine.executor, "dead", None)
    return str(why) if why else None


def final_output(rid: str, reason: str, message: str) -> RequestOutput:
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", [], reason, None, message)], finished=True)
