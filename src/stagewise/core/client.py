"""The caller's side of an engine: `EngineClient` for an asyncio caller (the server) of an engine
core (core.py) in a process of its own, `InprocClient` for a caller in this process (the offline
`LLM`). Both take requests as `PromptInput`s with their `SamplingParams`, refuse bad ones with one
sentence (the same `check_prompt` rules), and hand back `RequestOutput`s.

EngineClient:

It owns request ids, each caller's output queue, aborts when a caller leaves, engine death
(fail everyone, report unhealthy), the shutdown drain (refuse new requests, cut the open ones at
the deadline) and the facts read at start-up (`EngineInfo`); it knows no HTTP. Requests are
checked here (the tokenizer stays in this process), so bad input is refused before anything is
sent; a sender thread writes to the core, so a large request never blocks the event loop on a
full pipe. The core's messages are read on the event loop (`loop.add_reader`) and their deltas
assembled into the cumulative `RequestOutput`s callers stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Iterator

from ..engine.inputs import check_request
from ..errors import LoraInUseError, LoraNotFoundError, describe_exit
from ..request import RequestOutput, SamplingParams
from .core import engine_facts, final_output
from .core_runner import EXIT_WAIT_S, await_ready, kill_core, reap, start_core, stop_core
from .deltas import OutputAssembler
from .wire import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    EngineDied,
    EngineFacts,
    EngineOutputs,
    LoraUpdated,
    NewRequest,
    OutputDelta,
    Params,
    StopEngine,
    TensorRecord,
    UpdateLora,
    WireError,
    recv_core,
    send,
)

log = logging.getLogger("stagewise.server")
SHUTTING_DOWN = "The request was aborted because the server is shutting down; retry later."
LORA_UPDATE_WAIT_S = 120.0     # the engine reads an adapter between steps; a long step delays the answer
STALL_S = 10.0         # the core publishes at least every second; this long silent with work open is a stall


class ServerUnavailable(RuntimeError):
    """The engine died or the server is shutting down; new requests are refused (HTTP 503)."""


@dataclass
class PromptInput:
    """One engine submission: exactly one of ids or embeddings, and its length in positions."""
    prompt_token_ids: list[int] | None = None
    input_embeds: Any = None                 # torch.Tensor [T, H]
    text: str | None = None                  # the prompt as the client wrote it (echoed back), if text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids or ()) if self.input_embeds is None else int(self.input_embeds.shape[0])


@dataclass
class EngineInfo(EngineFacts):
    """What the caller reads about the engine at start-up: the core's facts plus this process's
    tokenizer (engine.inputs.Tokenizer, or anything with its methods)."""
    tok: Any = None

    @classmethod
    def of(cls, tok, facts: EngineFacts) -> "EngineInfo":
        return cls(tok=tok, **{f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)})


class Submission:
    """The requests of one call (prompts x n), sharing one queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.index: dict[str, int] = {}
        self.pending: set[str] = set()

    def add(self, rid: str) -> None:
        self.index[rid] = len(self.index)
        self.pending.add(rid)

    def __len__(self) -> int:
        return len(self.index)


@dataclass
class _Stream:
    queue: asyncio.Queue
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    max_tokens: int | None = None
    started: bool = False             # an output arrived: the engine scheduled it (or ended it)
    ended: bool = False               # its final output was handed on: later ones (an abort's echo) are not


def _real_engine(config):
    from ..engine.engine import Engine
    return Engine(config)


def _tokenizer(config):
    from ..engine.inputs import Tokenizer
    return Tokenizer(config.load.model, config.load.tokenizer)


class EngineClient:
    """Starts the engine core and blocks until it is ready (its start-up error is raised here).
    `engine_factory(config)` builds the engine in the core; `tokenizer` defaults to the
    checkpoint's, loaded here while the engine loads; `in_process` runs the core in a thread."""

    def __init__(self, config, metrics=None, *, engine_factory=_real_engine, tokenizer=None, in_process=False):
        self._pipes = start_core(config, engine_factory, in_process)
        self._proc = self._pipes.runner
        try:
            tok = tokenizer if tokenizer is not None else _tokenizer(config)
            ready = await_ready(self._pipes)
        except BaseException:
            kill_core(self._pipes)
            raise
        self.info = EngineInfo.of(tok, ready.facts)
        self.snapshot: dict = ready.snapshot                # the engine's latest stats()
        self.last_heard = time.monotonic()                  # the core's last message (it sends one a second)
        self.metrics = metrics
        self.dead: str | None = None
        self.draining = False                               # shutting down: no new requests
        self.stopping = False
        self._lock = threading.Lock()                       # guards _streams and dead
        self._streams: dict[str, _Stream] = {}
        self._assembler = OutputAssembler()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[ClientMessage | None] = queue.SimpleQueue()
        self._lora_calls: dict[int, asyncio.Future] = {}    # UpdateLora call id -> its answer (event loop)
        self._lora_ids = itertools.count(1)
        threading.Thread(target=self._send_forever, name="stagewise-engine-sender", daemon=True).start()

    # lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._pipes.from_core.fileno(), self._on_readable)

    def stop(self) -> None:
        """Let the core abort what is open and shut down (stage processes included), then reap it."""
        if self.stopping:
            return
        self.stopping = True
        self._outbox.put(StopEngine())
        stop_core(self._pipes)
        self._outbox.put(None)
        self._fail_all(SHUTTING_DOWN, "abort")

    @property
    def is_healthy(self) -> bool:
        return (self.dead is None and not self.draining and not self.stopping and self._proc.is_alive()
                and not self.recovering)

    @property
    def recovering(self) -> str | None:
        """Why the engine is rebuilding its pipeline, while it is (requests are still accepted: they wait)."""
        return (self.snapshot.get("recovery") or {}).get("recovering")

    @property
    def stalled_s(self) -> float | None:
        """Seconds the core has sent nothing while requests are open, once past STALL_S (a step, or a
        stage waiting on storage, holds it): /health shows it. None while it answers."""
        quiet = time.monotonic() - self.last_heard
        return quiet if quiet > STALL_S and self._streams else None

    @property
    def unhealthy_reason(self) -> str:
        if self.dead:
            return self.dead
        if self.recovering and not (self.draining or self.stopping):
            return f"Recovering: the pipeline is being rebuilt after a failure ({self.recovering})"
        return "The server is shutting down."

    # the shutdown drain (event loop thread)
    def begin_drain(self) -> None:
        """Refuse new requests (503) and report unhealthy; open requests run on."""
        self.draining = True

    @property
    def num_open(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests submitted that the engine has not started (no output yet)."""
        with self._lock:
            return sum(1 for s in self._streams.values() if not s.started)

    def cut_open(self, why: str) -> None:
        """End every open request now with `why` (an abort), and stop computing them."""
        with self._lock:
            ids = list(self._streams)
        self._fail_all(why, "abort")   # NOTE: first, so the engine's own abort replies land after `why`
        self._abort(ids)

    # requests (event loop thread)
    def submit(self, inputs: list[PromptInput], params: list[SamplingParams], tenant: int | None = None) -> Submission:
        """Queue every input, all or none: raises ValueError (bad input) or ServerUnavailable.
        The caller must `stream()` the submission or `release()` it. `tenant`: whose requests (the
        scheduler alternates between tenants with waiting requests)."""
        if self.dead or self.stopping or self.draining:
            raise ServerUnavailable(self.dead or "The server is shutting down; retry later.")
        for inp, p in zip(inputs, params):
            check_request(self.info.tok, self.info, p, inp.prompt_token_ids, inp.input_embeds)
        sub = Submission()
        with self._lock:
            if self.dead or self.stopping:
                raise ServerUnavailable(self.dead or "The server is shutting down; retry later.")
            new = []
            for inp, p in zip(inputs, params):
                rid = f"req-{uuid.uuid4().hex}"
                self._streams[rid] = _Stream(sub.queue, inp.prompt_token_ids or [], inp.num_tokens,
                                             max_tokens=p.max_tokens)
                sub.add(rid)
                new.append(NewRequest(rid, inp.prompt_token_ids, TensorRecord.of(inp.input_embeds), Params.of(p),
                                      tenant))
        self._outbox.put(AddRequests(new))
        return sub

    async def stream(self, sub: Submission) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Yield (index, cumulative output) until every request finishes. Leaving early (caller gone,
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
            if sub.pending:
                self._abort(list(sub.pending))
            sub.pending.clear()
            for rid in sub.index:
                self._streams.pop(rid, None)

    def num_prompt_tokens(self, rid: str) -> int:
        entry = self._streams.get(rid)
        return entry.num_prompt_tokens if entry else 0

    async def update_lora(self, name: str, path: str | None, base_names: tuple[str, ...] = ()) -> None:
        """Load (`path` set) or unload a LoRA adapter in the engine; `info.lora_names` holds the answer's
        adapters. Raises ValueError (LoraNotFoundError, LoraInUseError) with the engine's sentence."""
        if self.dead or self.stopping:
            raise ServerUnavailable(self.dead or "The server is shutting down; retry later.")
        call_id = next(self._lora_ids)
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lora_calls[call_id] = answer
        self._outbox.put(UpdateLora(call_id, name, path, list(base_names)))
        try:
            msg: LoraUpdated = await asyncio.wait_for(answer, LORA_UPDATE_WAIT_S)
        except asyncio.TimeoutError:
            raise ServerUnavailable(f"The engine did not answer the LoRA update within {LORA_UPDATE_WAIT_S:.0f} s; "
                                    f"retry later.") from None
        finally:
            self._lora_calls.pop(call_id, None)
        if msg.error is not None:
            raise {"not_found": LoraNotFoundError, "in_use": LoraInUseError}.get(msg.kind or "", ValueError)(msg.error)

    def _lora_answered(self, msg: LoraUpdated) -> None:
        self.info.lora_names = tuple(msg.lora_names)
        answer = self._lora_calls.get(msg.call_id)
        if answer is not None and not answer.done():
            answer.set_result(msg)

    def _abort(self, rids: list[str]) -> None:
        if rids:
            self._outbox.put(AbortRequests(rids))

    def _send_forever(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                send(self._pipes.to_core, msg)
            except OSError:         # the core is gone; the reader reports it
                return

    # outputs in (event loop)
    def _on_readable(self) -> None:
        conn = self._pipes.from_core
        try:
            while conn.poll():
                self._handle(recv_core(conn))
        except (EOFError, OSError):
            self._stop_reading()
            self._core_exited()
        except WireError as exc:         # a core of another version, or a bug: nothing after it can be trusted
            self._stop_reading()
            if self.dead is None:
                self._die(f"The engine process sent a message the server cannot read ({exc}); restart the server.", [])

    def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._pipes.from_core.fileno())

    def _handle(self, msg) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, EngineOutputs):
            if msg.snapshot is not None:
                self.snapshot = msg.snapshot
            self._dispatch(self._assemble(msg.deltas, msg.time))
        elif isinstance(msg, LoraUpdated):
            self._lora_answered(msg)
        elif isinstance(msg, EngineDied):
            self._die(msg.why, self._assemble(msg.deltas, time.monotonic()))

    def _assemble(self, deltas: list[OutputDelta], now: float) -> list[RequestOutput]:
        outputs = []
        for delta in deltas:
            s = self._streams.get(delta.request_id)
            if s is not None:
                s.started = True
            outputs.append(self._assembler.apply(delta, s.prompt_token_ids if s else [], s.arrival if s else None))
        self._observe(outputs, now)
        return outputs

    def _core_exited(self) -> None:
        # NOTE: reap it whatever happened before (a dead engine's process would stay <defunct>), unless
        # `stop` is reaping it on its thread already
        if self.stopping or not reap(self._pipes, EXIT_WAIT_S, wait_for_another=False) or self.dead:
            return
        how = describe_exit(self._proc.exitcode)
        self._die(f"The engine process (pid {self._proc.pid}) died unexpectedly: it {how}; restart the server.", [])

    def _observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Per-request metrics of the finished outputs; never costs a caller its answer."""
        if self.metrics is None:
            return
        try:
            for out in outputs:
                if out.finished:
                    entry = self._streams.get(out.request_id)
                    self.metrics.observe_finished(out, self.num_prompt_tokens(out.request_id), now,
                                                  entry.max_tokens if entry else None)
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
            if entry is not None and not entry.ended:
                entry.ended = out.finished
                entry.queue.put_nowait(out)

    def _die(self, why: str, outputs: list[RequestOutput]) -> None:
        """The engine is gone: deliver its last outputs, then fail every open request with `why`."""
        log.error("engine is dead: %s", why)
        with self._lock:
            self.dead = why
        self._post(outputs)
        self._fail_all(why, "error")
        self._assembler.clear()
        for answer in self._lora_calls.values():      # a LoRA update in flight: the core never answers it
            if not answer.done():
                answer.set_exception(ServerUnavailable(why))

    def _fail_all(self, why: str, reason: str) -> None:
        """Finish every stream still open with `reason` (after the real outputs already posted)."""
        with self._lock:
            ids = list(self._streams)
        self._post([final_output(rid, reason, why) for rid in ids])


class InprocClient:
    """An engine built and stepped on the caller's thread (the offline `LLM`): requests as the
    server's client takes them, checked by the engine as it adds them (`Engine.add_request`: the
    `check_prompt` rules `EngineClient.submit` runs), outputs as the engine makes them. Nothing
    crosses a process, so there is no core loop, pipe or delta in between; `engine` stays
    reachable for callers that drive or inspect it (the CLI's token stream, tests)."""

    def __init__(self, config, *, engine_factory=_real_engine):
        self.engine = engine_factory(config)
        self.info = EngineInfo.of(self.engine.tok, engine_facts(self.engine))

    def submit(self, inp: PromptInput, params: SamplingParams) -> str:
        """Queue one request; its id. ValueError (PromptTooLongError among them) on bad input. A text
        prompt without ids is tokenized by the engine, and its text is the output's `prompt`."""
        text = inp.text if inp.prompt_token_ids is None and inp.input_embeds is None else None
        req = self.engine.add_request(text, params, prompt_token_ids=inp.prompt_token_ids,
                                      input_embeds=inp.input_embeds)
        return req.request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def outputs(self) -> Iterator[RequestOutput]:
        """Step until every request submitted has finished, yielding each output as it changes."""
        return self.engine.run_until_done()

    def stats(self) -> dict:
        return self.engine.stats()

    def stop(self) -> None:
        self.engine.shutdown()
