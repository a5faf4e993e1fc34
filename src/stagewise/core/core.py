"""EngineCore: the serving loop around `Engine.step`, the one every served engine runs. It reads
client messages (adds, aborts, stop) from its inbox, steps while there is work, publishes
output deltas and the stats snapshot (at once when a step has outputs, else paced), notices a
stage that died while idle, and at stop aborts what is open and drains it (bounded).

`engine_main` runs it as the engine process of `stagewise serve` (spawned by `EngineClient`);
`serve` runs it wherever it is called (a thread of the client's process, for scripted engines
in tests). The loop never waits for the HTTP side: not for its GIL in the process layout, and
not for it to read (a thread of the core writes the pipe, so a full pipe holds up no step).
"""
from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection

from ..errors import EngineDeadError, LoraInUseError, LoraNotFoundError
from ..executor.hygiene import freeze_heap
from ..grammar.limits import GrammarLimits
from ..request import CompletionOutput, RequestOutput
from .deltas import DeltaEncoder
from .wire import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    CoreMessage,
    EngineDied,
    EngineFacts,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    ErrorRecord,
    LoraUpdated,
    NewRequest,
    StopEngine,
    UpdateLora,
    encode,
    recv_client,
    send,
)

log = logging.getLogger("stagewise.engine")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"      # the CLI's
IDLE_PUBLISH_S = 1.0          # an idle core refreshes the stats snapshot this often
BUSY_PUBLISH_S = 0.05         # a step without outputs still refreshes it this often
NO_PROGRESS_WAIT_S = 0.005    # nothing schedulable but work pending: wait instead of spinning
STOP_DRAIN_S = 5.0            # at stop, how long aborted requests get to leave the pipeline
OUTBOX_FLUSH_S = 10.0         # at exit, how long the last messages get to reach a slow client
ENGINE_FAULT = "The engine failed with an internal error (the server logged the details); restart the server."
# start-up errors the CLI prints as one line; anything else is logged here with its traceback
USER_ERRORS = (ValueError, FileNotFoundError, EngineDeadError)


class ClientGone(Exception):
    """The client closed its end of a pipe: nobody is left to serve."""


def engine_main(config, engine_factory, log_level: int, inbox: Connection, outbox: Connection) -> None:
    """Entry point of the engine process (multiprocessing spawn). It ignores SIGINT (the client
    drains, then stops it in order) and dies with its parent (PDEATHSIG)."""
    from ..executor.hygiene import die_with_parent, exit_now
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    _thread_lock_for_progress_bars()
    code = 1
    try:
        code = serve(config, engine_factory, inbox, outbox, own_process=True)
    finally:
        exit_now(code)        # skips interpreter teardown (seconds with torch loaded)


def _thread_lock_for_progress_bars() -> None:
    """tqdm's default lock is a multiprocessing RLock, which a spawned process registers with the
    resource tracker; this process ends with os._exit (no finalizers), so the tracker would warn of a
    leaked semaphore at every shutdown. Its bars are drawn by one process: a thread lock does."""
    import threading

    import tqdm
    tqdm.tqdm.set_lock(threading.RLock())


def serve(config, engine_factory, inbox: Connection, outbox: Connection, own_process: bool = False) -> int:
    """Build the engine with `engine_factory(config)`, say ready (or why not), serve until stopped.
    Returns the exit code: 0 stopped, 1 failed. `own_process`: the engine process (its heap is
    frozen once loaded; a core thread leaves its host process's collector alone)."""
    try:
        engine = engine_factory(config)
        ready = EngineReady(engine_facts(engine), engine.stats())
    except BaseException as exc:        # noqa: BLE001  (reported to the client, which raises it)
        if not isinstance(exc, USER_ERRORS):
            log.exception("the engine failed to start")
        _send_quietly(outbox, EngineFailed(ErrorRecord.of(exc)))
        return 1
    if own_process:
        freeze_heap()
    _send_quietly(outbox, ready)
    return EngineCore(engine, inbox, outbox).run()


def engine_facts(engine) -> EngineFacts:
    return EngineFacts(max_model_len=int(engine.max_model_len), kv_capacity_tokens=int(engine.kv_capacity_tokens),
                       model_dir=str(engine.model_dir), config_model=engine.config.load.model,
                       vocab_size=int(engine.tok.vocab_size),
                       grammar_limits=getattr(engine, "grammar_limits", None) or GrammarLimits(),
                       lora_names=tuple(getattr(engine, "lora_names", ())),
                       lora_runtime_updates=bool(getattr(engine, "lora_runtime_updates", False)))


def _send_quietly(conn: Connection, msg: CoreMessage) -> None:
    try:
        send(conn, msg)
    except OSError:
        pass


def final_output(rid: str, reason: str, message: str) -> RequestOutput:
    """The last output of a request the engine never ran (refused) or could not finish."""
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", [], reason, None, message)], finished=True)


class Outbox:
    """The core's messages to the client, written by a thread of their own, in order: a client that
    reads slowly (a busy event loop, a full pipe) never holds up a step. `put` raises ClientGone
    once a write found the client gone."""

    def __init__(self, conn: Connection):
        self.conn, self.gone = conn, False
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="stagewise-core-sender", daemon=True)
        self._thread.start()

    def put(self, msg: CoreMessage) -> None:
        if self.gone:
            raise ClientGone()
        self._queue.put(encode(msg))

    def close(self, timeout_s: float = OUTBOX_FLUSH_S) -> None:
        """Write what is queued (for up to `timeout_s`), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                self.gone = True
                return


def update_lora(engine, msg: UpdateLora) -> LoraUpdated:
    """Load or unload a LoRA adapter on the engine; a refusal travels as its sentence and kind."""
    try:
        if msg.path is None:
            engine.unload_lora(msg.name)
        else:
            engine.load_lora(msg.name, msg.path, tuple(msg.base_names))
    except ValueError as exc:
        kind = "not_found" if isinstance(exc, LoraNotFoundError) else "in_use" if isinstance(exc, LoraInUseError) \
            else "invalid"
        return LoraUpdated(msg.call_id, list(engine.lora_names), str(exc), kind)
    return LoraUpdated(msg.call_id, list(engine.lora_names))


class EngineCore:
    def __init__(self, engine, inbox: Connection, outbox: Connection):
        self.engine, self.inbox, self.outbox = engine, inbox, Outbox(outbox)
        self.encoder = DeltaEncoder()
        self.live: set[str] = set()                 # requests added and not finished
        self.refused: list[RequestOutput] = []      # final outputs of adds the engine refused
        self.stop_requested = False
        self.last_publish = 0.0

    def run(self) -> int:
        """Serve until the client says stop (0) or the engine dies (1)."""
        try:
            return self._run()
        finally:
            self.outbox.close()

    def _run(self) -> int:
        try:
            return self._serve()
        except ClientGone:
            log.warning("the client closed the engine's pipes; stopping the engine")
            self.engine.shutdown()
            return 0
        except Exception:                    # a bug of this loop: say so, never hang the client
            log.exception("the engine loop failed")
            if not self.outbox.gone:
                self.outbox.put(EngineDied(ENGINE_FAULT))
            self.engine.shutdown()
            return 1

    def _serve(self) -> int:
        while True:
            self._read(0.0 if self.engine.has_unfinished() or self.refused else IDLE_PUBLISH_S)
            if self.stop_requested:
                return self._stop()
            if not self.engine.has_unfinished():
                if self._died_idle():
                    return 1
                if self.refused or time.monotonic() - self.last_publish > IDLE_PUBLISH_S:
                    self._publish([])
                continue
            progressed = self._step()
            if progressed is None:
                return 1
            if not progressed:
                self._read(NO_PROGRESS_WAIT_S)

    def _died_idle(self) -> bool:
        why = self.engine.fault()
        if why:
            self._send(EngineDied(why))
            self.engine.shutdown()
        elif self.engine.recovering:
            self._publish([])         # /health says so before the rebuild blocks this loop
        return bool(why)

    # requests in
    def _read(self, timeout_s: float) -> None:
        """Handle every message waiting (after up to `timeout_s` for the first)."""
        try:
            if not self.inbox.poll(timeout_s):
                return
            while True:
                self._handle(recv_client(self.inbox))
                if not self.inbox.poll():
                    return
        except (EOFError, OSError):
            raise ClientGone() from None
        # NOTE: a WireError (a client of another version, or a bug) ends the loop as a fault: logged, EngineDied

    def _handle(self, msg: ClientMessage) -> None:
        if isinstance(msg, AddRequests):
            for r in msg.requests:
                self._add(r)
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.engine.abort(rid)
        elif isinstance(msg, UpdateLora):
            self._send(update_lora(self.engine, msg))
        elif isinstance(msg, StopEngine):
            self.stop_requested = True

    def _add(self, r: NewRequest) -> None:
        try:
            embeds = None if r.input_embeds is None else r.input_embeds.to_tensor()
            self.engine.add_request(params=r.params.to_sampling_params(), prompt_token_ids=r.prompt_token_ids,
                                    input_embeds=embeds, request_id=r.request_id, tenant=r.tenant)
            self.live.add(r.request_id)
        except Exception as exc:     # noqa: BLE001  (the client checked it; fail this request alone)
            log.error("request %s refused by the engine: %s", r.request_id, exc)
            self.refused.append(final_output(r.request_id, "error", str(exc)))

    # steps and outputs out
    def _step(self) -> bool | None:
        """One engine step; True if it did work, None if the engine died."""
        try:
            outputs = self.engine.step()
        except EngineDeadError as exc:
            self._send(EngineDied(str(exc), [self.encoder.encode(o) for o in exc.outputs]))
            return None
        except Exception:                    # a bug, not a request problem: stop serving loudly
            log.exception("engine step failed")
            self._send(EngineDied(ENGINE_FAULT))
            self.engine.shutdown()           # free the stage processes now
            return None
        # NOTE: a step that lost the pipeline publishes at once: the next one blocks in the rebuild
        if outputs or self.engine.recovering or time.monotonic() - self.last_publish > BUSY_PUBLISH_S:
            self._publish(outputs)
        return outputs.progressed

    def _publish(self, outputs: list[RequestOutput]) -> None:
        outputs = self.refused + outputs
        self.refused = []
        deltas = [self.encoder.encode(o) for o in outputs]
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        try:
            snapshot = self.engine.stats()
        except Exception:                    # stats must never take the loop down
            log.exception("engine.stats() failed")
            snapshot = None
        self.last_publish = time.monotonic()
        self._send(EngineOutputs(self.last_publish, deltas, snapshot))

    def _send(self, msg: CoreMessage) -> None:
        self.outbox.put(msg)

    def _stop(self) -> int:
        """Abort everything, let the aborts leave the pipeline (bounded), stop the engine."""
        for rid in list(self.live):
            self.engine.abort(rid)
        deadline = time.monotonic() + STOP_DRAIN_S
        # NOTE: a stop while a failed pipeline waits to be rebuilt has nothing to drain (no rebuild)
        while (self.engine.has_unfinished() and not self.engine.recovering
               and time.monotonic() < deadline):
            if self._step() is None:
                return 1
        self._publish([])
        self.engine.shutdown()
        return 0
