"""The server tests' process helpers: `ServerProcess` (`python -m stagewise serve` as a child process,
shared with the serving benchmarks: benchmarks/server_process.py), `descendants` and `wait_gone`."""
from __future__ import annotations

import time
from pathlib import Path

from benchmarks.server_process import HOST, ServerProcess, descendants

__all__ = ["HOST", "ServerProcess", "descendants", "wait_gone"]


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
