"""The warm process of a node (`stagewise-warm` in ps): it imports what a stage needs once (torch,
the engine, the checkpoint's config and model code), starts no thread that outlives a fork, and
then forks stage processes on demand, each in milliseconds and for any stage and layer range; a
stage sets up its own thread pools after the fork (runtime/threads.py, cpu_pool.py), as a fresh
process does. The stages are the warm process's children: it reaps them and reports their exit
codes here, where each is a `ForkedStage` with what the executor uses of a multiprocessing.Process.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait as wait_ready
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import NoReturn

from .hygiene import die_with_parent, exit_now, forked_from, name_process, track
from .idle_priority import back_to_normal, warm_at_idle_priority

log = logging.getLogger("stagewise.executor")
# Variables read when a library loads (OpenMP, BLAS, the allocator, the interpreter): a stage forked
# from a warm process started under other values would not see them, so such a change retires it.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TCMALLOC_", "MALLOC_", "LD_", "PYTHON",
                      "TORCH", "PYTORCH_", "STAGEWISE_MALLOC")
GONE = "it exited"
FORK_WAIT_S = 60.0            # a fork takes milliseconds; a warm process this slow to answer is stopped or stuck
EXIT_WAIT_S = 1.0             # a stage that ended: how long its exit code may take to come from the warm process


def supported() -> bool:
    """Linux with process file descriptors (kernel 5.3+): how this process watches stages it did not fork."""
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def load_time_env(environ=os.environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(LOAD_TIME_PREFIXES)}


class Zygote:
    """This process's handle on a warm process (started here with multiprocessing's spawn, so it
    inherits this environment and dies with this process)."""

    def __init__(self, model_dir: str):
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=zygote_main, args=(there, model_dir), name="stagewise-warm", daemon=True)
        self.proc.start()
        there.close()
        track(self.proc)
        self.env, self.model_dir, self.started_at = load_time_env(), model_dir, time.monotonic()
        self.warm = False
        self.cold: str | None = None                # why it cannot fork stages (it then exits)
        self.warm_s: float | None = None            # seconds from its start until it was warm
        self.exits: dict[int, int] = {}             # pid -> exit code of its stages that ended
        self.lock = threading.Lock()

    def usable(self) -> bool:
        """Alive, not cold, started under this environment's load-time variables."""
        return self.proc.is_alive() and self.cold is None and self.env == load_time_env()

    def wait_warm(self, timeout_s: float) -> bool:
        """Wait (up to timeout_s; 0: only read what it said) until it has imported everything;
        False if it is not there yet, died or went cold."""
        deadline = time.monotonic() + timeout_s
        while not self.warm and self.cold is None:
            with self.lock:           # NOTE: taken per second, so a stage's exit code is never held up long
                try:
                    if self.conn.poll(min(max(deadline - time.monotonic(), 0.0), 1.0)):
                        self._read()
                        continue
                except (EOFError, OSError):
                    break
            if time.monotonic() >= deadline:
                break
        return self.warm and self.proc.is_alive()

    def fork(self, args: tuple, name: str) -> ForkedStage:
        """Fork a stage process running `stage_main(*args)` in this process's environment."""
        request = (args, dict(os.environ), list(sys.path), os.getcwd())
        deadline = time.monotonic() + FORK_WAIT_S
        with self.lock:
            self.conn.send(request)
            while self.conn.poll(max(deadline - time.monotonic(), 0.0)):
                kind, *rest = self._read()
                if kind == "forked":
                    return ForkedStage(self, rest[0], recv_handle(self.conn), name)
                if kind == "failed":
                    raise RuntimeError(f"the warm process could not fork {name}: {rest[0]}")
        self.proc.kill()          # NOTE: stopped or stuck: a late fork must not start a stray stage
        self.cold = GONE
        raise RuntimeError(f"the warm process did not fork {name} within {FORK_WAIT_S:.0f} s")

    def _read(self) -> tuple:
        """The next message from the warm process (EOFError once it is gone); exit codes are kept."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.cold = self.cold or GONE
            raise EOFError("the warm process exited") from None
        if msg[0] == "exit":
            self.exits[msg[1]] = msg[2]
        elif msg[0] == "warm":
            self.warm = True
        elif msg[0] == "cold":
            self.cold = msg[1]
            log.warning("stage processes start fresh (with their imports) on this node: %s", msg[1])
        return msg

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        """The exit code of an ended stage, as the warm process reaped it (-9 once that is gone too)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while pid not in self.exits:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    if self.conn.poll(min(left, 0.1)):
                        self._read()
                except (EOFError, OSError):         # the warm process is gone (or stopped here)
                    return -signal.SIGKILL        # it died with its warm process (PR_SET_PDEATHSIG)
            return self.exits[pid]

    def stop(self) -> None:
        """End the warm process: closing its pipe ends it (its stages die with it); SIGKILL if it lingers."""
        self.conn.close()
        self.proc.join(1.0)
        if self.proc.is_alive():
            self.proc.kill()


class ForkedStage:
    """A stage process forked by a warm process: pid, name, sentinel (a pidfd: readable once it
    ended), is_alive, exitcode, join, kill, as multiprocessing.Process has them."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int, name: str):
        self.zygote, self.pid, self.sentinel, self.name = zygote, pid, pidfd, name
        self._exitcode: int | None = None
        track(self)

    def __del__(self):
        try:
            os.close(self.sentinel)
        except (OSError, AttributeError):
            pass

    def is_alive(self) -> bool:
        return self._exitcode is None and not wait_ready([self.sentinel], 0)

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and not self.is_alive():
            # NOTE: a zombie's status is there before the warm process reaps it (it may be stopped or busy)
            code = self.zygote.exits.get(self.pid)
            code = _zombie_exit_code(self.pid) if code is None else code
            self._exitcode = self.zygote.exit_code(self.pid, EXIT_WAIT_S) if code is None else code
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if wait_ready([self.sentinel], timeout):
            _ = self.exitcode

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)   # never another process that got its pid
        except (ProcessLookupError, OSError):
            pass

    terminate = kill


def _zombie_exit_code(pid: int) -> int | None:
    """The exit code of an ended, not yet reaped process (field 52 of /proc/PID/stat: its wait
    status), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


def zygote_main(conn, model_dir: str) -> None:
    """The warm process: import, check that no thread outlives a fork, say "warm", then fork a stage
    for each request until the pipe closes; report each stage's exit code."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_process("stagewise-warm")
    # NOTE: the imports (seconds of CPU) run at idle priority beside the node's running stages; the
    # process is back at normal priority before it forks any stage (a fork must not wait for idle CPU)
    idle = warm_at_idle_priority()
    try:
        _warm_up(model_dir)
        threads = _threads_after_fork()
    except Exception as exc:  # noqa: BLE001  (the stages report a bad checkpoint; here it only means no warm start)
        _cold(conn, f"preparing the warm process failed ({type(exc).__name__}: {exc})")
    if idle:
        back_to_normal()
    if threads > 1:        # NOTE: a forked child would inherit a thread pool whose threads it lacks (a hang)
        _cold(conn, f"{threads - 1} thread(s) of the warm process survive a fork")
    gc.freeze()            # the stages' collections then skip (and do not copy) everything imported here
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(sig_w)
    conn.send(("warm",))
    while True:
        ready = wait_ready([conn, sig_r])
        if sig_r in ready:
            _reap(conn, sig_r)
        if conn in ready:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                exit_now(0)
            _fork_one(conn, request, (sig_r, sig_w))


def _warm_up(model_dir: str) -> None:
    """Import what a stage imports before it loads weights (the model class of this checkpoint too)."""
    from ..checkpoint.facts import read_facts
    from ..model.registry import get_model_class
    from ..runtime import worker  # noqa: F401
    from . import stage_proc  # noqa: F401
    hf = read_facts(model_dir).config
    for arch in getattr(hf, "architectures", None) or []:
        try:
            get_model_class(arch)
        except (KeyError, ValueError):
            pass


def _threads_after_fork() -> int:
    """This process's threads once a child was forked: thread pools that stop at a fork (OpenBLAS's)
    do not count; anything else (an OpenMP team, a Python thread) would be lost in a child."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return len(os.listdir("/proc/self/task"))


def _cold(conn, why: str) -> NoReturn:
    try:
        conn.send(("cold", why))
    finally:
        exit_now(0)


def _reap(conn, sig_r: int) -> None:
    try:
        os.read(sig_r, 4096)
    except BlockingIOError:
        pass
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))


def _fork_one(conn, request: tuple, wakeup: tuple[int, int]) -> None:
    try:
        pid = os.fork()
    except OSError as exc:
        conn.send(("failed", str(exc)))
        return
    if pid == 0:
        _run_stage(conn, request, wakeup)
    pidfd = os.pidfd_open(pid)     # before any reap: it names this child, whatever happens to its pid
    try:
        conn.send(("forked", pid))
        send_handle(conn, pidfd, os.getppid())
    finally:
        os.close(pidfd)


def _run_stage(conn, request: tuple, wakeup: tuple[int, int]) -> None:
    """In the forked child: drop the warm process's pipe and signal set-up, take the requesting
    process's environment, path and directory, and run the stage (it never returns)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        conn.close()
        forked_from(os.getppid())
        args, environ, path, cwd = request
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        os.chdir(cwd)
        from .stage_proc import stage_main
        stage_main(*args)
        code = 0
    except BaseException:  # noqa: BLE001  (whatever happens, this child never returns into the warm loop)
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)
