"""Where an engine core runs, for `EngineClient`: a spawned process of its own (what `stagewise
serve` uses: the HTTP event loop and the step loop never wait for each other's GIL), or a thread
of the client's process (scripted engines in tests). Either way the two sides speak the same
messages over a pipe pair, so the client cannot tell them apart; `CoreRunner` is the little it
needs: liveness, the exit code, and stopping.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Callable, Protocol

from .. import envs
from ..errors import EngineDeadError, describe_exit
from .core import STOP_DRAIN_S, engine_main, serve
from .wire import EngineFailed, EngineReady, recv_core

STARTUP_POLL_S = 0.1
EXIT_WAIT_S = 2.0             # after the core closed its pipe: time for its exit code to show
STOP_WAIT_S = 10.0 + STOP_DRAIN_S


class CoreRunner(Protocol):
    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...     # None while running; < 0: killed by that signal

    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...


@dataclass
class CorePipes:
    runner: CoreRunner
    to_core: Connection
    from_core: Connection
    reaping: threading.Lock = field(default_factory=threading.Lock)


def reap(pipes: CorePipes, timeout_s: float, wait_for_another: bool = True) -> bool:
    """Join the core, one thread at a time. Two threads in waitpid for one child race: the loser
    reads ECHILD, which multiprocessing reports as still running (a false "did not stop" and a kill
    of a process that had exited). Without `wait_for_another`, returns False at once while another
    thread reaps it."""
    if not pipes.reaping.acquire(blocking=wait_for_another):
        return False
    try:
        pipes.runner.join(timeout_s)
    finally:
        pipes.reaping.release()
    return True


class CoreThread(threading.Thread):
    """The core in a thread of this process; `kill` cannot stop a thread, so it only closes the
    pipe the core reads (the core then stops its engine and returns)."""

    def __init__(self, config, engine_factory: Callable, inbox: Connection, outbox: Connection):
        super().__init__(name="stagewise-engine-core", daemon=True)
        self.pid: int | None = os.getpid()
        self.exitcode: int | None = None
        self._args = (config, engine_factory, inbox, outbox)
        # the thread's exit and `kill` may close the inbox at once: a second close of its fd would
        # fail (EBADF) or, worse, close whatever file took the number in between
        self._closing = threading.Lock()

    def run(self) -> None:
        try:
            self.exitcode = serve(*self._args)
        except BaseException:                # noqa: BLE001  (serve reports its own faults; never hang)
            logging.getLogger("stagewise.engine").exception("the engine core thread failed")
            self.exitcode = 1
        finally:
            with self._closing:
                for conn in self._args[2:]:
                    conn.close()

    def kill(self) -> None:
        with self._closing:
            self._args[2].close()


def start_core(config, engine_factory: Callable, in_process: bool = False) -> CorePipes:
    """Start a core that builds its engine with `engine_factory(config)` (a module-level callable
    when spawned); returns at once, before the engine is ready."""
    ctx = mp.get_context("spawn")
    core_in, to_core = ctx.Pipe(duplex=False)
    from_core, core_out = ctx.Pipe(duplex=False)
    runner: CoreRunner
    if in_process:
        runner = CoreThread(config, engine_factory, core_in, core_out)
        runner.start()
        return CorePipes(runner, to_core, from_core)
    nice = envs.STAGEWISE_HTTP_NICE          # a bad value fails here, before anything is spawned
    # NOTE: not a daemon: at PP > 1 the engine process spawns the stage processes itself
    proc = ctx.Process(target=engine_main, name="stagewise-engine", daemon=False,
                       args=(config, engine_factory, logging.getLogger().getEffectiveLevel(), core_in, core_out))
    proc.start()
    core_in.close()
    core_out.close()
    yield_cpu_to_core(nice)
    return CorePipes(proc, to_core, from_core)


_yielded = [False]


def yield_cpu_to_core(nice: int | None = None) -> None:
    """Lower the calling thread's priority below the engine core's, once per process (threads it
    starts later inherit it): where the engine's threads fill every core, the HTTP side's bursts
    (JSON, SSE writes) then take a CPU when one is idle instead of preempting an engine thread in
    the middle of a step, which every other thread of that step would wait for.

    NOTE: on Linux a nice value belongs to a thread; the engine process, spawned before, keeps its own."""
    nice = envs.STAGEWISE_HTTP_NICE if nice is None else nice
    if _yielded[0] or nice <= 0 or not hasattr(os, "setpriority"):
        return
    _yielded[0] = True
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError:
        pass


def await_ready(pipes: CorePipes) -> EngineReady:
    """Block until the core says ready; raises its start-up error, or says how it exited."""
    while not pipes.from_core.poll(STARTUP_POLL_S):
        if not pipes.runner.is_alive():
            raise _exited_while_starting(pipes.runner)
    try:
        msg = recv_core(pipes.from_core)
    except (EOFError, OSError):
        pipes.runner.join(EXIT_WAIT_S)
        raise _exited_while_starting(pipes.runner) from None
    if isinstance(msg, EngineFailed):
        raise msg.error.to_exception()
    assert isinstance(msg, EngineReady), msg
    return msg


def _exited_while_starting(runner: CoreRunner) -> EngineDeadError:
    return EngineDeadError(f"The engine process {describe_exit(runner.exitcode)} while starting (see the log "
                           f"above); fix the cause and restart the server.")


def stop_core(pipes: CorePipes, timeout_s: float = STOP_WAIT_S) -> None:
    """Wait for a core told to stop; kill it if it lingers."""
    reap(pipes, timeout_s)
    if still_running(pipes.runner):
        logging.getLogger("stagewise.engine").warning("the engine did not stop within %.0f s; killing it", timeout_s)
        kill_core(pipes)


def still_running(runner: CoreRunner) -> bool:
    """`is_alive`, but a process something else reaped is not running: multiprocessing's waitpid
    then fails with ECHILD, which it reports as alive (a false "did not stop" right after a clean
    exit, and a kill of a pid that is gone)."""
    if not runner.is_alive():
        return False
    if isinstance(runner, CoreThread) or runner.pid is None:
        return True
    try:
        os.kill(runner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def kill_core(pipes: CorePipes) -> None:
    if still_running(pipes.runner):
        pipes.runner.kill()       # a process's stage processes follow (PDEATHSIG)
    reap(pipes, 5.0)
