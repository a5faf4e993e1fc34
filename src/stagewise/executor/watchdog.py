"""Prompt stop on SIGINT/SIGTERM for a command-line node, even while its main thread waits in C++.

Python runs signal handlers only between bytecodes of the main thread, so a node blocked in C
(a torchrun store call, a join) would ignore Ctrl-C and SIGTERM until that call returns. The signal
still wakes a watcher thread (through `signal.set_wakeup_fd`): if the process has not exited
`grace_s` later, it kills this node's stage processes and exits. A handler that lands inside a
message transfer stops the node at once (unwinding there would leave a half-read message on a
link that the orderly shutdown reuses); peers see the closed links and stop. A process that
unwound exits at once too, skipping seconds of torch teardown. Signals another handler owns
(the server's graceful drain) are left to it.
"""
from __future__ import annotations

import atexit
import signal
import socket
import sys
import threading
import time
from typing import NoReturn

from ..cluster import transport
from .hygiene import exit_now

GRACE_S = 1.5
_installed = False
_stop_signal: int | None = None          # the first SIGINT/SIGTERM our handlers own


def _exit_on_term(signum, frame):
    _unwind_when_safe(signum, frame, SystemExit(128 + signum))   # `finally` blocks stop the stages


def _interrupt(signum, frame):
    _unwind_when_safe(signum, frame, KeyboardInterrupt())


def _unwind_when_safe(signum: int, frame, exc: BaseException) -> None:
    _note_stop(signum)
    while frame is not None:
        if frame.f_code.co_filename == transport.__file__:
            _hard_stop(signum)
        frame = frame.f_back
    raise exc


def _note_stop(signum: int) -> None:
    global _stop_signal
    _stop_signal = _stop_signal or signum


OUR_HANDLERS = {signal.SIGTERM: _exit_on_term, signal.SIGINT: _interrupt}


def install(grace_s: float = GRACE_S) -> bool:
    """Take over SIGINT/SIGTERM for this process (main thread only); False if that is not possible."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return _installed
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:            # an event loop listens already: leave signals to it
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return False
    for signum, handler in OUR_HANDLERS.items():
        signal.signal(signum, handler)
    threading.Thread(target=_watch, args=(reader, writer, grace_s), daemon=True, name="stagewise-stop").start()
    atexit.register(_exit_now_if_stopping)
    _installed = True
    return True


def _watch(reader: socket.socket, writer: socket.socket, grace_s: float) -> None:
    """`writer` stays referenced here: closing it would silence the wakeup fd."""
    signum = _first_owned_signal(reader)
    _note_stop(signum)
    time.sleep(grace_s)
    print(f"stagewise: {signal.Signals(signum).name} did not stop the process within {grace_s:.1f} s "
          f"(it was waiting outside Python); killing its stage processes.", file=sys.stderr)
    _hard_stop(signum)


def _first_owned_signal(reader: socket.socket) -> int:
    while True:
        for signum in reader.recv(64):
            if signal.getsignal(signum) is OUR_HANDLERS.get(signal.Signals(signum)):
                return signum


def _exit_now_if_stopping() -> None:
    """At exit after a stop signal: everything has unwound; skip the slow teardown of torch."""
    if _stop_signal is not None:
        _hard_stop(_stop_signal)


def _hard_stop(signum: int) -> NoReturn:
    exit_now(128 + signum)
