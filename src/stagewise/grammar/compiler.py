"""The grammar compile supervisor: a process of its own (started by grammar/service.py) that
checks each constraint against the limits, then compiles it in a child forked for that one compile,
with an address-space limit (its share of --grammar-memory), a CPU-time limit and a wall-clock
deadline, at most `workers` children at once, and answers with the compiled grammar serialized
(xgrammar's JSON). A child that runs out of memory or time, or crashes, ends alone: neither the
engine nor another request ever sees it. Cancelled jobs are dropped, or their child killed.

Messages (tuples over a socket pair): in `("compile", job_id, kind, text)`, `("cancel", job_id)`, `("stop",)`;
out `("ready",)`, `("done", job_id, serialized)`, `("failed", job_id, status, message)`.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from .limits import JSON_OBJECT_SCHEMA, GrammarLimits, GrammarRefused, check_limits

NICE = 10                     # compiles yield the CPU to the engine's steps
WALL_FACTOR = 3.0             # the wall-clock deadline, in CPU budgets (a busy machine stretches a compile)
MIB = 1 << 20


def main(fd: int, parent_pid: int) -> None:
    """Entry point of the supervisor process (`python -m stagewise.grammar.compiler FD PID`):
    its end of a socket pair, on which the first message is (tokenizer info as JSON, limits)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    conn = Connection(fd)
    tokenizer_info_json, limits = conn.recv()
    import xgrammar as xgr
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    conn.send(("ready",))
    CompileServer(conn, info, limits).run()
    os._exit(0)               # its compiles are killed; interpreter teardown (torch loaded) takes seconds


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL when the parent goes (and at once if it already went)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


@dataclass
class _Child:
    pid: int
    reader: Connection
    deadline: float


class CompileServer:
    def __init__(self, conn: Connection, info, limits: GrammarLimits):
        self.conn, self.info, self.limits = conn, info, limits
        self.queue: deque[tuple[int, str, str]] = deque()
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
            self._kill(job_id)
            self._answer(job_id, "failed", 408, self._timeout_message())
        while self.queue and len(self.children) < self.limits.workers:
            self._start(*self.queue.popleft())
        return True

    def _command(self) -> bool:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            return False
        if msg[0] == "compile":
            self.queue.append(msg[1:])
        elif msg[0] == "cancel":
            job_id = msg[1]
            self.queue = deque(j for j in self.queue if j[0] != job_id)
            if job_id in self.children:
                self._kill(job_id)
        return msg[0] != "stop"

    def _start(self, job_id: int, kind: str, text: str) -> None:
        try:
            check_limits(kind, text, self.limits)
        except GrammarRefused as exc:
            self._answer(job_id, "failed", exc.status, str(exc))
            return
        reader, writer = _pipe()
        pid = os.fork()
        if pid == 0:                                      # the child: compile, answer, exit
            reader.close()
            self.conn.close()
            _child_main(writer, self.info, kind, text, self.limits)
        writer.close()
        deadline = time.monotonic() + WALL_FACTOR * self.limits.compile_timeout_s + 1.0
        self.children[job_id] = _Child(pid, reader, deadline)

    def _collect(self, job_id: int) -> None:
        child = self.children.pop(job_id)
        try:
            answer = child.reader.recv()
        except (EOFError, OSError):
            answer = None
        child.reader.close()
        _, status = os.waitpid(child.pid, 0)
        if answer is None:
            answer = ("failed", *self._death(status))
        self._answer(job_id, *answer)

    def _kill(self, job_id: int) -> None:
        child = self.children.pop(job_id)
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(child.pid, 0)
        child.reader.close()

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


def memory_message(limits: GrammarLimits) -> str:
    return (f"Compiling the grammar needed more than its {limits.memory_per_compile // MIB} MiB of memory "
            f"(--grammar-memory / --grammar-compile-workers); simplify the constraint.")


def _pipe() -> tuple[Connection, Connection]:
    import multiprocessing as mp
    return mp.Pipe(duplex=False)


def _child_main(writer: Connection, info, kind: str, text: str, limits: GrammarLimits) -> None:
    """In the forked child: limit this process, compile, send one answer, exit without cleanup."""
    code = 0
    try:
        _die_with_parent(os.getppid())
        _limit_self(limits)
        writer.send(("done", compile_text(info, kind, text, limits)))
    except GrammarRefused as exc:
        writer.send(("failed", exc.status, str(exc)))
    except MemoryError:
        writer.send(("failed", 400, memory_message(limits)))
    except Exception as exc:        # noqa: BLE001  (any compiler error is this grammar's)
        message = memory_message(limits) if "bad_alloc" in str(exc) else \
            f"The grammar compiler rejected the constraint: {first_line(exc)}"
        writer.send(("failed", 400, message))
    except BaseException:           # noqa: BLE001  (never return into the supervisor's loop)
        code = 1
    finally:
        os._exit(code)


def _limit_self(limits: GrammarLimits) -> None:
    """An address-space limit of what this process maps now plus its memory share, and a CPU limit
    (SIGXCPU at the budget, SIGKILL a second later)."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + limits.memory_per_compile
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    cpu = max(1, int(limits.compile_timeout_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def compile_text(info, kind: str, text: str, limits: GrammarLimits) -> str:
    """Compile `text` of `kind` (StructuredOutputs.key) for `info`; the serialized result."""
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    # NOTE: compact JSON (no free whitespace): small models otherwise loop on newlines and indents
    if kind == "json":
        compiled = compiler.compile_json_schema(text, any_whitespace=False)
    elif kind == "json_object":
        compiled = compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
    elif kind == "regex":
        compiled = compiler.compile_regex(text)
    elif kind == "choice":
        compiled = compiler.compile_grammar(choice_ebnf(json.loads(text)))
    else:
        compiled = compiler.compile_grammar(text)
    _check_not_empty(xgr, compiled, info)
    data = compiled.serialize_json()
    if len(data) > limits.cache_memory:
        raise GrammarRefused(f"The compiled grammar is {len(data) // MIB} MiB, more than this server keeps for one "
                             f"({limits.cache_memory // MIB} MiB, --grammar-cache-memory); simplify the constraint.")
    return data


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _check_not_empty(xgr, compiled, info) -> None:
    """A grammar whose first step allows no token of the vocabulary can never produce output."""
    bits = xgr.allocate_token_bitmask(1, info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bits)
    if not bits.any():
        raise GrammarRefused("The constraint allows no token of this model's vocabulary (its language is empty "
                             "for this tokenizer); fix the constraint.")


def first_line(exc: BaseException) -> str:
    """The message of a backend error, without its C++ source location."""
    import re
    lines = [t.strip() for t in str(exc).splitlines() if t.strip()]
    prefix = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")     # "[14:29:10] /project/cpp/x.cc:94: "
    line = prefix.sub("", next((t for t in lines if prefix.match(t)), lines[0] if lines else type(exc).__name__))
    return line[:300].rstrip(".") + "."


if __name__ == "__main__":
    import sys
    main(int(sys.argv[1]), int(sys.argv[2]))
