"""`stagewise serve` as a child process on 127.0.0.1 and a free port, for the serving benchmarks:
started through the command line (the public entry point), waited for through /health, stopped
with a signal and then SIGKILL."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"             # loopback only, by design


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: str | Path | None, log_path: Path, *args: str, log_level: str = "warning"):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = Path(log_path)
        model = ["--model", str(model_dir)] if model_dir is not None else []
        cmd = [sys.executable, "-m", "stagewise", "--log-level", log_level, "serve", *model,
               "--host", HOST, "--port", str(self.port), *args]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{self.log_path.read_text()[-3000:]}")

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
