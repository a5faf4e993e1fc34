"""`stagewise generate` as a new user runs it: wall time of the default prompt on the default model,
as the defaults run it (`--prefill-graph auto`: a job this small does not compile) and with
`--prefill-graph compiled` (compiled in the background while the answer runs eager) with a cold
Inductor cache (a fresh directory every run) and a warm one, against `--prefill-graph off`; each a
fresh process, the configurations alternating round by round. Target: at most 1.1x the `off`
run's wall time, cold and warm. Kernel libraries and the model file are cached beforehand (one
untimed run), as for a user's second command; Inductor's cache is the only thing that is cold.
Writes benchmarks/results/startup.md.

    python -m benchmarks.offline startup [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_line, load_line, markdown_table, met, write_result

CONFIGS = {"--prefill-graph off": "off", "the default (auto)": "auto",
           "--prefill-graph compiled, cold Inductor cache": "compiled",
           "--prefill-graph compiled, warm Inductor cache": "compiled"}


def generate(cache_dir: Path, graph: str) -> tuple[float, str]:
    """Wall seconds of one `stagewise generate` (default model and prompt) and its summary line."""
    cmd = [sys.executable, "-m", "stagewise", "--log-level", "WARNING", "generate", "--prefill-graph", graph]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return wall, out.stderr.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    walls: dict[str, list[float]] = {c: [] for c in CONFIGS}
    summaries: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"
        prime = [sys.executable, "-c", "from stagewise import LLM; LLM(compile_in_background=False)"]
        subprocess.run(prime, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(warm)), check=True,
                       capture_output=True, timeout=1800)   # kernels, model file, the warm cache: untimed
        for r in range(args.rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]
            for config in order:
                cache = warm if "cold" not in config else Path(tmp) / f"cold-{r}"
                wall, summary = generate(cache, CONFIGS[config])
                walls[config].append(wall)
                summaries[config] = summary
                print(f"round {r + 1} {config}: {wall:.1f} s ({summary})", flush=True)
    off = next(iter(CONFIGS))
    base = min(walls[off])
    rows = [[c, ", ".join(f"{w:.1f}" for w in walls[c]), f"{min(walls[c]) / base:.2f}x",
             met(min(walls[c]) / base, 1.1, higher_is_better=False) if c != off else "", summaries[c]]
            for c in CONFIGS]
    text = "\n".join(["# `stagewise generate` wall time: the default, a background compile, no compile", "",
                      cpu_line(),
                      f"{load_line()}. Default model and prompt, fresh processes, {args.rounds} rounds alternating; "
                      "best run per configuration against the best `off` run.", "",
                      markdown_table(["configuration", "wall s (each round)", "vs off", "<= 1.1x",
                                      "summary line (last run)"], rows)])
    print(text)
    print(f"wrote {write_result('startup', text)}; median off {statistics.median(walls[off]):.1f} s")
    return 0
