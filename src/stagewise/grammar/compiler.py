"""The grammar compile supervisor: a process of its own (started by grammar/service.py) that
checks each constraint against the limits, then compiles it in a child forked for that one compile
(grammar/compile_child.py), with an address-space limit, a CPU-time limit and a wall-clock deadline
that start when the child does, and answers with the compiled grammar serialized (xgrammar's JSON).
A child that runs out of memory or time, or crashes, ends alone: neither the engine nor another
request ever sees it. Cancelled jobs are dropped, or their child killed.

Two lanes, so that slow compiles cannot hold up a fresh small one: `workers` children take jobs
first come first served, each with its share of --grammar-memory and the full CPU budget; while
they are all busy, one more child, the quick lane, tries the smallest job not yet tried there with
QUICK_CPU_S of CPU and an eighth of the memory (a job half its size or less takes the lane over).
A job over the quick lane's budget (or memory) goes back to its place in the queue for a worker,
its budgets fresh: it lost at most QUICK_CPU_S.

Messages (tuples over a socket pair): in `("compile", job_id, kind, text)`, `("cancel", job_id)`, `("stop",)`;
out `("ready",)`, `("done", job_id, serialized)`, `("failed", job_id, status, message)`.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from .compile_child import MIB, child_main, die_with_parent, memory_message
from .limits import GrammarLimits, GrammarRefused, check_limits

NICE = 10                     # compiles yield the CPU to the engine's steps
WALL_FACTOR = 3.0             # the wall-clock deadline, in CPU budgets (a busy machine stretches a compile)
QUICK_CPU_S = 1               # the quick lane's CPU budget (RLIMIT_CPU counts whole seconds)


def main(fd: int, parent_pid: int) -> None:
    """Entry point of the supervisor process (`python -m stagewise.grammar.compiler FD PID`):
    its end of a socket pair, on which the first message is (tokenizer info as JSON, limits)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    conn = Connection(fd)
    tokenizer_info_json, limits = conn.recv()
    import xgrammar as xgr
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    conn.send(("ready",))
    CompileServer(conn, info, limits).run()
    os._exit(0)               # its compiles are killed; interpreter teardown (torch loaded) takes seconds


@dataclass(eq=False)
class _Job:
    job_id: int
    kind: str
    text: str
    tried: bool = False       # it ran over the quick lane's budget: only a worker takes it now


@dataclass
class _Child:
    pid: int
    reader: Connection
    deadline: float
    job: _Job
    quick: bool


class CompileServer:
    def __init__(self, conn: Connection, info, limits: GrammarLimits):
        self.conn, self.info, self.limits = conn, info, limits
        self.queue: list[_Job] = []                      # in arrival (job id) order
        self.children: dict[int, _Child] = {}            # job id -> its compile

    def run(self) -> None:
        try:
            while self._serve_once():
                pass
        finally:
            for job_id in list(self.children):
                self._kill(job_id)

    def _serve_once(self) -> bool:
        """One round: read commands, collect finished children, enforce deadlines, start queued jobs.
        False once told to stop (or the engine is gone)."""
        now = time.monotonic()
        timeout = min((c.deadline - now for c in self.children.values()), default=1.0)
        readers = [self.conn, *(c.reader for c in self.children.values())]
        for conn in wait(readers, max(0.0, timeout)):
            if conn is self.conn:
                if not self._command():
                    return False
                continue
            # NOTE: a cancel read in this round may have killed the child whose pipe is ready
            job_id = next((j for j, c in self.children.items() if c.reader is conn), None)
            if job_id is not None:
                self._collect(job_id)
        now = time.monotonic()
        for job_id in [j for j, c in self.children.items() if c.deadline <= now]:
            child = self._kill(job_id)
            self._requeue(child.job) if child.quick else self._answer(job_id, "failed", 408, self._timeout_message())
        self._start_queued()
        return True

    def _start_queued(self) -> None:
        """Workers take the oldest jobs; while they are all busy the quick lane takes the smallest
        job it has not tried (a trivial schema behind slow regexes compiles at once)."""
        workers = sum(not c.quick for c in self.children.values())
        while self.queue and workers < self.limits.workers:
            self._start(self.queue.pop(0), quick=False)
            workers += 1
        untried = [j for j in self.queue if not j.tried]
        if not untried:
            return
        job = min(untried, key=lambda j: len(j.text))
        quick = next((c for c in self.children.values() if c.quick), None)
        if quick is not None and len(job.text) * 2 <= len(quick.job.text):
            self._kill(quick.job.job_id)             # a much smaller job goes first; this one tries again
            self._requeue(quick.job, tried=False)
        elif quick is not None:
            return
        self.queue.remove(job)
        self._start(job, quick=True)

    def _requeue(self, job: _Job, tried: bool = True) -> None:
        """Back to its place in the queue (arrival order)."""
        job.tried = tried
        self.queue.insert(next((i for i, j in enumerate(self.queue) if j.job_id > job.job_id), len(self.queue)), job)

    def _command(self) -> bool:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            return False
        if msg[0] == "compile":
            self.queue.append(_Job(*msg[1:]))
        elif msg[0] == "cancel":
            job_id = msg[1]
            self.queue = [j for j in self.queue if j.job_id != job_id]
            if job_id in self.children:
                self._kill(job_id)
        return msg[0] != "stop"

    def _start(self, job: _Job, quick: bool) -> None:
        try:
            check_limits(job.kind, job.text, self.limits)
        except GrammarRefused as exc:
            self._answer(job.job_id, "failed", exc.status, str(exc))
            return
        cpu_s = QUICK_CPU_S if quick else max(1, int(self.limits.compile_timeout_s + 0.999))
        memory = self.limits.quick_memory if quick else self.limits.memory_per_compile
        reader, writer = _pipe()
        pid = os.fork()
        if pid == 0:                                      # the child: compile, answer, exit
            reader.close()
            self.conn.close()
            child_main(writer, self.info, job.kind, job.text, self.limits, memory, cpu_s)
        writer.close()
        budget = QUICK_CPU_S if quick else self.limits.compile_timeout_s
        deadline = time.monotonic() + WALL_FACTOR * budget + 1.0      # from the compile's start, not the queue
        self.children[job.job_id] = _Child(pid, reader, deadline, job, quick)

    def _collect(self, job_id: int) -> None:
        child = self.children.pop(job_id)
        try:
            answer = child.reader.recv()
        except (EOFError, OSError):
            answer = None
        child.reader.close()
        _, status = os.waitpid(child.pid, 0)
        if child.quick and (answer is None or answer[0] == "oom"):
            self._requeue(child.job)                      # over the quick lane's budget: a worker decides
        elif answer is None:
            self._answer(job_id, "failed", *self._death(status))
        elif answer[0] == "oom":
            self._answer(job_id, "failed", 400, memory_message(self.limits))
        else:
            self._answer(job_id, *answer)

    def _kill(self, job_id: int) -> _Child:
        child = self.children.pop(job_id)
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(child.pid, 0)
        child.reader.close()
        return child

    def _answer(self, job_id: int, verdict: str, *rest) -> None:
        try:
            self.conn.send((verdict, job_id, *rest))
        except (OSError, ValueError):
            pass                                          # the engine is gone; `_command` sees it next

    def _timeout_message(self) -> str:
        return (f"The grammar did not compile within this server's budget of {self.limits.compile_timeout_s:g} s "
                f"(--grammar-compile-timeout-s raises it); simplify the constraint.")

    def _death(self, status: int) -> tuple[int, str]:
        """(status, message) for a child that died without answering."""
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
            return 408, self._timeout_message()       # past its CPU budget (SIGKILL: the hard limit)
        return 400, (f"The grammar compiler failed on this constraint (it ran out of its "
                f"{self.limits.memory_per_compile // MIB} MiB of memory, --grammar-memory / "
                f"--grammar-compile-workers, or crashed); simplify the constraint.")


def _pipe() -> tuple[Connection, Connection]:
    import multiprocessing as mp
    return mp.Pipe(duplex=False)


if __name__ == "__main__":
    import sys
    main(int(sys.argv[1]), int(sys.argv[2]))
