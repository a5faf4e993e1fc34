"""`stagewise serve` as a child process on 127.0.0.1 and a free port, for the serving benchmarks and
the server tests (tests/server/launcher.py): started through the command line (the public entry
point), waited for through /health, stopped with a signal and then SIGKILL; the processes below it
(its engine process, the stage processes) found through /proc."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

HOST = "127.0.0.1"             # loopback only, by design


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: str | Path | None, log_path: Path, *args: str, log_level: str = "warning",
                 env: dict[str, str] | None = None):
        """`stagewise serve` on a free port; `env` (default: this process's) is the server's environment."""
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = Path(log_path)
        model = ["--model", str(model_dir)] if model_dir is not None else []
        cmd = [sys.executable, "-m", "stagewise", "--log-level", log_level, "serve", *model,
               "--host", HOST, "--port", str(self.port), *args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ if env is None else env, TOKENIZERS_PARALLELISM="false"))

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        wait_healthy(self.url, timeout_s, self.proc.poll, lambda: ":\n" + self.log_path.read_text()[-3000:])

    def metric(self, name: str) -> list[float]:
        """The values of the counter or gauge `name` on /metrics, one per label set, in its order."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " "))]

    def descendants(self) -> list[int]:
        """Pids of every process below the server (its engine process, the stage processes)."""
        return descendants(self.proc.pid)

    def stop(self, grace_s: float = 15.0, sig: int = signal.SIGINT) -> int | None:
        """`sig` (graceful), then SIGKILL if it lingers; returns the exit code. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


def wait_healthy(url: str, timeout_s: float, exited: Callable[[], int | None], detail: Callable[[], str] = lambda: "",
                 interval_s: float = 0.2) -> None:
    """Poll `url`/health until it answers 200. RuntimeError, `detail()` appended, once `exited()`
    returns the server's exit code (None while it runs) or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = exited()
        if code is not None:
            raise RuntimeError(f"server exited with {code}{detail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s{detail()}")


def process_parents() -> dict[int, int]:
    """pid -> parent pid of every living process (read from /proc; Linux)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parents


def descendants(pid: int) -> list[int]:
    """Pids of every living process below `pid`."""
    parents = process_parents()
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found
