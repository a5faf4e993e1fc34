"""ProcessEngine: the server's default layout. The engine runs in a spawned process of its own
(engine_child.py), as vLLM runs its engine core, so the HTTP event loop and the engine's step
loop never wait for each other's GIL. Requests are checked here (the tokenizer stays in this
process) and sent in batches; each engine step comes back as one message of output deltas that
the event loop reads (`loop.add_reader`) and turns into cumulative outputs.

A sender thread writes to the engine, so a large request never blocks the event loop on a full
pipe. The engine process dying (or saying it died) fails every open request and turns /health 503.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import pickle
import queue
import threading
import time

from ..errors import EngineDeadError
from ..request import Request, SamplingParams
from .bridge import SHUTTING_DOWN, AsyncEngine, EngineInfo, PromptInput
from .deltas import OutputAssembler
from .engine_child import STOP_DRAIN_S, engine_main

log = logging.getLogger("stagewise.server")
STARTUP_POLL_S = 0.1
EXIT_WAIT_S = 2.0             # after the engine closed its pipe: time for its exit code to show


def _real_engine(config):
    from ..engine.engine import Engine
    return Engine(config)


class ProcessEngine(AsyncEngine):
    """Starts the engine process and blocks until it is ready (its start-up error is raised here).
    `engine_factory(config)` builds the engine in the child (a module-level callable); `tokenizer`
    defaults to the checkpoint's, loaded here while the engine loads."""

    def __init__(self, config, metrics=None, *, engine_factory=_real_engine, tokenizer=None):
        ctx = mp.get_context("spawn")
        to_engine_r, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine_w = ctx.Pipe(duplex=False)
        # NOTE: not a daemon: at PP > 1 the engine process spawns the stage processes itself
        self._proc = ctx.Process(target=engine_main, name="stagewise-engine", daemon=False,
                                 args=(config, engine_factory, logging.getLogger().getEffectiveLevel(), to_engine_r,
                                       from_engine_w))
        self._proc.start()
        to_engine_r.close()
        from_engine_w.close()
        try:
            tok = tokenizer if tokenizer is not None else _tokenizer(config)
            facts, snapshot = self._await_ready()
        except BaseException:
            self._kill()
            raise
        super().__init__(EngineInfo(tok=tok, **facts), snapshot, metrics)
        self._assembler = OutputAssembler()
        self._meta: dict[str, tuple[list[int], int, float]] = {}   # id -> (prompt ids, prompt length, arrival)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_forever, name="stagewise-engine-sender", daemon=True)
        self._sender.start()
        self._stopped = False

    def _await_ready(self) -> tuple[dict, dict]:
        while not self._from_engine.poll(STARTUP_POLL_S):
            if not self._proc.is_alive():
                raise EngineDeadError(f"The engine process exited with code {self._proc.exitcode} while starting "
                                      f"(see the log above); fix the cause and restart the server.")
        try:
            msg = pickle.loads(self._from_engine.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(EXIT_WAIT_S)
            raise EngineDeadError(f"The engine process exited with code {self._proc.exitcode} while starting "
                                  f"(see the log above); fix the cause and restart the server.") from None
        if msg[0] == "failed":
            raise msg[1]
        return msg[1], msg[2]

    # lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_engine.fileno(), self._on_readable)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Let the engine abort what is open and shut down (stage processes included), then reap it."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping = True
        self._outbox.put(("stop",))
        self._proc.join(timeout_s + STOP_DRAIN_S)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s + STOP_DRAIN_S)
            self._kill()
        self._outbox.put(None)
        self._fail_all(SHUTTING_DOWN, "abort")

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()       # its stage processes follow (PDEATHSIG)
        self._proc.join(5.0)

    def _engine_alive(self) -> bool:
        return self._proc.is_alive()

    # requests out
    def _add(self, items: list[tuple[str, PromptInput, SamplingParams]]) -> None:
        for rid, inp, params in items:         # all checked before any is sent: all or none
            check_request(self.info, inp, params)
        now = time.monotonic()
        for rid, inp, _ in items:
            self._meta[rid] = (inp.prompt_token_ids or [], inp.num_tokens, now)
        self._outbox.put(("add", [(rid, inp.prompt_token_ids, inp.input_embeds, p) for rid, inp, p in items]))

    def _abort(self, rids: list[str]) -> None:
        if rids:
            self._outbox.put(("abort", rids))

    def _send_forever(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._to_engine.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:         # the engine is gone; the reader reports it
                return

    # outputs in (event loop)
    def _on_readable(self) -> None:
        try:
            while self._from_engine.poll():
                self._handle(pickle.loads(self._from_engine.recv_bytes()))
        except (EOFError, OSError):
            self._loop.remove_reader(self._from_engine.fileno())
            self._engine_exited()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, now, deltas, snapshot = msg
            if snapshot is not None:
                self.snapshot = snapshot
            outputs = self._assemble(deltas, now)
            self._dispatch(outputs)
        elif kind == "dead":
            self._die(msg[1], self._assemble(msg[2], time.monotonic()))

    def _assemble(self, deltas: list, now: float) -> list:
        outputs = []
        for delta in deltas:
            prompt_ids, _, arrival = self._meta.get(delta[0], ([], 0, None))
            outputs.append(self._assembler.apply(delta, prompt_ids, arrival))
        self._observe(outputs, now)
        for out in outputs:
            if out.finished:
                self._meta.pop(out.request_id, None)
        return outputs

    def num_prompt_tokens(self, rid: str) -> int:
        entry = self._meta.get(rid)
        return entry[1] if entry else 0

    def _engine_exited(self) -> None:
        if self.stopping or self.dead:
            return
        self._proc.join(EXIT_WAIT_S)
        self._die(f"The engine process (pid {self._proc.pid}) died unexpectedly with exit code "
                  f"{self._proc.exitcode}; restart the server.", [])

    def _die(self, why: str, outputs: list) -> None:
        super()._die(why, outputs)
        self._meta.clear()
        self._assembler.clear()


def _tokenizer(config):
    from ..engine.inputs import Tokenizer
    return Tokenizer(config.model, config.tokenizer)


def check_request(info: EngineInfo, inp: PromptInput, params: SamplingParams) -> None:
    """The checks `Engine.add_request` makes, here, so bad input is a 400 before anything is sent."""
    from ..engine.inputs import Tokenizer, check_prompt
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}.")
    # NOTE: called on the class: the server's tokenizer may be any object with `hidden_size`
    ids, embeds = Tokenizer.encode_prompt(info.tok, None, inp.prompt_token_ids, inp.input_embeds)
    check_prompt(Request("check", ids, params, input_embeds=embeds), info.max_model_len, info.kv_capacity_tokens,
                 info.vocab_size)
