"""The engine process of `stagewise serve`: owns the `Engine` and runs its step loop, so the
engine never waits for the HTTP side's GIL. Two pipes connect it to the server: requests in
(batched adds, aborts, stop) and one message per step out (output deltas, the stats snapshot, a
timestamp). It ignores SIGINT (the server drains, then stops it in order) and dies with the
server (PDEATHSIG); at PP > 1 it is the driver that spawns the stage processes.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time

from ..errors import EngineDeadError
from .bridge import (ENGINE_FAULT, IDLE_PUBLISH_S, NO_PROGRESS_WAIT_S, engine_facts, final_output,
                     idle_stage_death)
from .deltas import DeltaEncoder

log = logging.getLogger("stagewise.server")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"      # the CLI's
BUSY_PUBLISH_S = 0.05         # a step without outputs still refreshes it this often
STOP_DRAIN_S = 5.0            # at stop, how long aborted requests get to leave the pipeline
# start-up errors the CLI prints as one line; anything else is logged here with its traceback
USER_ERRORS = (ValueError, FileNotFoundError, EngineDeadError)


class ServerGone(Exception):
    """The server closed its end of a pipe: nobody is left to serve."""


def engine_main(config, engine_factory, log_level: int, inbox, outbox) -> None:
    """Entry point of the engine process (multiprocessing spawn)."""
    from ..executor.launch import die_with_parent
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    code = 1
    try:
        engine = _start(config, engine_factory, outbox)
        if engine is not None:
            code = EngineLoop(engine, inbox, outbox).run()
    finally:
        # NOTE: skip interpreter teardown (seconds with torch loaded); nothing is left to flush
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(config, engine_factory, outbox):
    try:
        engine = engine_factory(config)
        ready = ("ready", engine_facts(engine), engine.stats())
    except BaseException as exc:        # noqa: BLE001  (reported to the server, which raises it)
        if not isinstance(exc, USER_ERRORS):
            log.exception("the engine failed to start")
        _send_quietly(outbox, ("failed", _picklable(exc)))
        return None
    _send_quietly(outbox, ready)
    return engine


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:                   # noqa: BLE001  (an exception type that does not round-trip)
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _send_quietly(conn, msg) -> None:
    try:
        conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass


class EngineLoop:
    def __init__(self, engine, inbox, outbox):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.encoder = DeltaEncoder()
        self.live: set[str] = set()          # requests added and not finished
        self.refused: list = []               # final outputs of adds the engine refused
        self.stop_requested = False
        self.last_publish = 0.0

    def run(self) -> int:
        """Serve until the server says stop (0) or the engine dies (1)."""
        try:
            return self._serve()
        except ServerGone:
            log.warning("the server closed the engine's pipes; stopping the engine")
            self.engine.shutdown()
            return 0
        except Exception:                    # a bug of this loop: say so, never hang the server
            log.exception("the engine loop failed")
            _send_quietly(self.outbox, ("dead", ENGINE_FAULT, []))
            self.engine.shutdown()
            return 1

    def _serve(self) -> int:
        while True:
            self._read(0.0 if self.engine.has_unfinished() or self.refused else IDLE_PUBLISH_S)
            if self.stop_requested:
                return self._stop()
            if not self.engine.has_unfinished():
                why = idle_stage_death(self.engine)
                if why:
                    self._send(("dead", why, []))
                    self.engine.shutdown()
                    return 1
                if self.refused or time.monotonic() - self.last_publish > IDLE_PUBLISH_S:
                    self._publish([])
                continue
            progressed = self._step()
            if progressed is None:
                return 1
            if not progressed:
                self._read(NO_PROGRESS_WAIT_S)

    # requests in
    def _read(self, timeout_s: float) -> None:
        """Handle every message waiting (after up to `timeout_s` for the first)."""
        try:
            if not self.inbox.poll(timeout_s):
                return
            while True:
                self._handle(pickle.loads(self.inbox.recv_bytes()))
                if not self.inbox.poll():
                    return
        except (EOFError, OSError):
            raise ServerGone() from None

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            for rid, ids, embeds, params in msg[1]:
                try:
                    self.engine.add_request(params=params, prompt_token_ids=ids, input_embeds=embeds, request_id=rid)
                    self.live.add(rid)
                except Exception as exc:     # noqa: BLE001  (the server checked it; fail this request alone)
                    log.error("request %s refused by the engine: %s", rid, exc)
                    self.refused.append(final_output(rid, "error", str(exc)))
        elif kind == "abort":
            for rid in msg[1]:
                self.engine.abort(rid)
        elif kind == "stop":
            self.stop_requested = True

    # steps and outputs out
    def _step(self) -> bool | None:
        """One engine step; True if it did work, None if the engine died."""
        plan_id = self.engine.scheduler.next_plan_id
        try:
            outputs = self.engine.step()
        except EngineDeadError as exc:
            self._send(("dead", str(exc), [self.encoder.encode(o) for o in exc.outputs]))
            return None
        except Exception:                    # a bug, not a request problem: stop serving loudly
            log.exception("engine step failed")
            self._send(("dead", ENGINE_FAULT, []))
            self.engine.shutdown()           # free the stage processes now
            return None
        if outputs or time.monotonic() - self.last_publish > BUSY_PUBLISH_S:
            self._publish(outputs)
        return bool(outputs) or self.engine.scheduler.next_plan_id != plan_id

    def _publish(self, outputs: list) -> None:
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
        self._send(("step", self.last_publish, deltas, snapshot))

    def _send(self, msg: tuple) -> None:
        try:
            self.outbox.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise ServerGone() from None

    def _stop(self) -> int:
        """Abort everything, let the aborts leave the pipeline (bounded), stop the engine."""
        for rid in list(self.live):
            self.engine.abort(rid)
        deadline = time.monotonic() + STOP_DRAIN_S
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            if self._step() is None:
                return 1
        self._publish([])
        self.engine.shutdown()
        return 0
