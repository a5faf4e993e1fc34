"""Grammar compilation for the engine, never on its step loop: `submit` answers from the cache of
compiled grammars or queues a job and returns at once; a service thread starts the compile supervisor
(grammar/compiler.py, a process of its own), sends it the jobs, deserializes what comes
back and resolves each job's future. The step loop only polls futures.

One job per (tenant, kind, text): the choices of one request, and requests alike, share it; tenants
(cache salts) share neither jobs nor cache entries, so no one can time another's grammars. A job
whose requests all ended is cancelled (its compile killed). The cache is bounded in entries and in
bytes, least recently used out.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import subprocess
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from .limits import GrammarLimits, GrammarRefused

log = logging.getLogger("stagewise.engine")
THREAD_STOP_S = 5.0
SUPERVISOR_STOP_S = 2.0
START_TIMEOUT_S = 300.0          # the supervisor imports xgrammar (and torch) before it is ready
UNAVAILABLE = 503
Key = tuple[str, str, str]       # (tenant, kind, text)


@dataclass(eq=False)
class _Job:
    job_id: int
    key: Key
    future: Future = field(default_factory=Future)
    waiters: int = 1


@dataclass(eq=False)
class Ticket:
    """One request's claim on a compiled grammar: `future` resolves to it, or raises GrammarRefused."""
    future: Future
    job: _Job | None = None          # None: answered from the cache


class GrammarCache:
    """Compiled grammars by key, bounded in entries and bytes; least recently used out."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[Key, tuple[Any, int]] = OrderedDict()
        self.num_bytes = 0

    def get(self, key: Key) -> Any:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        return entry[0]

    def put(self, key: Key, value: Any, num_bytes: int) -> None:
        if key in self.entries:
            self.num_bytes -= self.entries.pop(key)[1]
        self.entries[key] = (value, num_bytes)
        self.num_bytes += num_bytes
        while self.entries and (len(self.entries) > self.max_entries or self.num_bytes > self.max_bytes):
            self.num_bytes -= self.entries.popitem(last=False)[1][1]


class CompileService:
    """`make_backend()` (run on the service thread: it may take seconds) builds the object holding the
    tokenizer info (`.info`) that compiled grammars are deserialized for; it is `backend` afterwards."""

    def __init__(self, make_backend: Callable[[], Any], limits: GrammarLimits):
        self.limits = limits
        self.backend: Any = None
        self._make_backend = make_backend
        self._lock = threading.Lock()
        self._cache = GrammarCache(limits.cache_entries, limits.cache_memory)
        self._jobs: dict[Key, _Job] = {}
        self._by_id: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)     # a full pipe already says "wake up"
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._conn: Any = None
        self._supervisor_ready = False
        self._stopping = False

    # the step loop's side (never blocks)
    def submit(self, tenant: str, kind: str, text: str) -> Ticket:
        key = (tenant, kind, text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                done: Future = Future()
                done.set_result(compiled)
                return Ticket(done)
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(next(self._ids), key)
                self._by_id[job.job_id] = job
                self._commands.put(("compile", job.job_id, kind, text))
            else:
                job.waiters += 1
        self._start_thread()
        self._wake()
        return Ticket(job.future, job)

    def cancel(self, ticket: Ticket) -> None:
        """The ticket's request ended: its job is cancelled (the compile killed) once no request waits."""
        job = ticket.job
        if job is None:
            return
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or self._by_id.get(job.job_id) is not job:
                return
            self._forget(job)
        job.future.cancel()
        self._commands.put(("cancel", job.job_id))
        self._wake()

    @property
    def supervisor_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    def stats(self) -> dict:
        with self._lock:
            return {"cached": len(self._cache.entries), "cached_bytes": self._cache.num_bytes,
                    "compiling": len(self._by_id)}

    def shutdown(self) -> None:
        self._stopping = True
        self._wake()
        self._hang_up()                   # frees the thread if a send to the supervisor blocks it
        if self._thread is not None:
            self._thread.join(THREAD_STOP_S)
        self._stop_supervisor()
        if self._thread is None or not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # the service thread
    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="stagewise-grammar", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self.backend = self.backend or self._make_backend()
            while not self._stopping:
                self._serve_once()
        except Exception:                # noqa: BLE001  (a bug here fails grammars, never the engine)
            if self._stopping:           # the hang-up at shutdown ended a start-up or a send midway
                self._fail_all("The server is shutting down; retry the request elsewhere.")
                return
            log.exception("the grammar compile service failed")
            self._fail_all("The grammar compiler failed (the server logged why); retry, or restart the server.")
        finally:
            self._stop_supervisor()

    def _serve_once(self) -> None:
        """Send what the step loop queued (starting the supervisor first if needed), then wait up to
        a second for answers or a wake-up."""
        if self._proc is None and not self._commands.empty():
            self._start_supervisor()
        while self._proc is not None:
            try:
                self._conn.send(self._commands.get_nowait())
            except queue.Empty:
                break
            except OSError:               # hung up at shutdown, or the supervisor died: the reads below tell
                break
        for conn in wait([self._wake_r] + ([self._conn] if self._proc is not None else []), 1.0):
            if conn == self._wake_r:
                os.read(self._wake_r, 4096)
                continue
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self._supervisor_died()
                return
            self._answer(msg)

    def _supervisor_died(self) -> None:
        proc, self._proc = self._proc, None
        if self._stopping or proc is None:
            return
        log.error("the grammar compile supervisor (pid %d) exited with %s; the next grammar starts a new one",
                  proc.pid, proc.wait())
        self._conn.close()
        self._fail_all("The grammar compiler stopped unexpectedly; retry the request.")

    def _answer(self, msg: tuple) -> None:
        verdict, job_id, *rest = msg
        with self._lock:
            job = self._by_id.get(job_id)
            if job is not None:
                self._forget(job)
        if job is None:                   # cancelled meanwhile
            return
        if verdict == "failed":
            job.future.set_exception(GrammarRefused(rest[1], rest[0]))
            return
        try:
            compiled = self.backend.deserialize(rest[0])
        except Exception as exc:         # noqa: BLE001
            log.exception("a compiled grammar could not be loaded")
            job.future.set_exception(GrammarRefused(f"The compiled grammar could not be loaded ({exc}).", 500))
            return
        with self._lock:
            self._cache.put(job.key, compiled, int(compiled.memory_size_bytes))
        job.future.set_result(compiled)

    def _forget(self, job: _Job) -> None:
        """Under the lock: the job leaves the tables."""
        self._by_id.pop(job.job_id, None)
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]

    def _fail_all(self, why: str) -> None:
        """Every job in flight fails (503: retry); commands not yet sent are dropped with them."""
        with self._lock:
            jobs = list(self._by_id.values())
            for job in jobs:
                self._forget(job)
        while True:
            try:
                self._commands.get_nowait()
            except queue.Empty:
                break
        for job in jobs:
            job.future.set_exception(GrammarRefused(why, UNAVAILABLE))

    def _start_supervisor(self) -> None:
        """`python -m ...supervisor` on one end of a socket pair (not multiprocessing: an offline
        script without a main guard must not be re-imported)."""
        import sys
        ours, theirs = socket.socketpair()
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "stagewise.grammar.compiler", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((self.backend.info.serialize_json(), self.limits))
        self._supervisor_ready = False
        if not self._conn.poll(START_TIMEOUT_S) or self._conn.recv() != ("ready",):
            raise RuntimeError("the grammar compile supervisor did not start")
        self._supervisor_ready = True

    def _stop_supervisor(self) -> None:
        self._hang_up()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            # NOTE: one still starting (importing xgrammar) compiles nothing and reads no socket yet
            proc.wait(SUPERVISOR_STOP_S if self._supervisor_ready else 0)
        except subprocess.TimeoutExpired:
            if self._supervisor_ready:
                log.warning("the grammar compile supervisor (pid %d) did not exit when its socket closed; "
                            "killing it", proc.pid)
            proc.kill()
            proc.wait(SUPERVISOR_STOP_S)
        self._conn.close()

    def _hang_up(self) -> None:
        """Shut the supervisor's socket down both ways. Not a "stop" message: that could wait behind
        two blocked sends (the supervisor answering with a compiled grammar nobody reads any more,
        this side sending it a schema, each socket buffer full), for seconds. A shutdown returns
        both sends at once, and the supervisor reads EOF, kills its compiles and exits."""
        conn = self._conn
        if self._proc is None or conn is None or conn.closed:
            return
        try:
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
