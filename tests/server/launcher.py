"""ServerProcess: `python -m stagewise serve` as a child process on 127.0.0.1 and a free port,
waited for through /health and stopped gracefully (a signal, then SIGKILL). Used by the server
tests; the process itself is the serving benchmarks' (benchmarks/server_process.py)."""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.server_process import HOST
from benchmarks.server_process import ServerProcess as BenchServerProcess

__all__ = ["HOST", "ServerProcess", "descendants", "wait_gone"]


class ServerProcess(BenchServerProcess):
    """The benchmarks' server process (started, waited for and stopped alike), plus what the
    tests look at: the processes below it."""

    def descendants(self) -> list[int]:
        """Pids of every process below the server (its engine process, the stage processes)."""
        return descendants(self.proc.pid)


def descendants(pid: int) -> list[int]:
    """Pids of every living process below `pid` (read from /proc; Linux)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of `pids` runs (zombies count as gone); returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
