"""Prompt stop on SIGINT/SIGTERM for a command-line node, even while its main thread waits in C++.

Python runs signal handlers only between bytecodes of the main thread, so a node blocked in a
gloo connect or receive would ignore Ctrl-C and SIGTERM until that call returns. The signal
still wakes a watcher thread (through `signal.set_wakeup_fd`): if the process has not exited
`grace_s` later, it kills this node's stage processes and exits. A process that unwound in time
exits at once too, skipping seconds of interpreter teardown. While another handler owns a
signal (the HTTP server's graceful drain), the watcher leaves that signal to it.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time

GRACE_S = 1.5
_installed = False
_stop_signal: int | None = None          # the first SIGINT/SIGTERM our handlers own


def _exit_on_term(signum, frame):
    _note_stop(signum)
    raise SystemExit(128 + signum)          # unwinds like Ctrl-C, so `finally` blocks stop the stages


def _interrupt(signum, frame):
    _note_stop(signum)
    raise KeyboardInterrupt


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
    while True:
        for signum in reader.recv(64):
            if signal.getsignal(signum) is OUR_HANDLERS.get(signum):
                _note_stop(signum)
                time.sleep(grace_s)
                print(f"stagewise: {signal.Signals(signum).name} did not stop the process within {grace_s:.1f} s "
                      f"(it was waiting in torch.distributed); killing its stage processes.", file=sys.stderr)
                _hard_stop(signum)


def _exit_now_if_stopping() -> None:
    """At exit after a stop signal: everything has unwound; skip the slow teardown of torch."""
    if _stop_signal is not None:
        _hard_stop(_stop_signal)


def _hard_stop(signum: int) -> None:
    from .launch import kill_local_stages
    kill_local_stages()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)
