"""The worker of benchmarks/offline/cpu_limit.py: one configuration's batch-1 decode in its own
process (stagewise, or llama.cpp under a venv with llama-cpp-python: standard library + llama_cpp
there), printed as one `CPU-LIMIT {json}` line.

    PYTHON benchmarks/workers/cpu_limit_worker.py SPEC_JSON
"""
from __future__ import annotations

import json
import os
import sys
import time

MARK = "CPU-LIMIT "
PROMPT = [1, 504, 3458, 282, 4649, 314, 1978, 30, 216, 504, 3458, 282, 4649, 314]


def stagewise_worker(spec: dict) -> dict:
    import torch

    from stagewise import LLM, SamplingParams
    options = dict(device="cpu", kv_cache_memory="256MiB", max_model_len=1024, compile_in_background=False,
                   threads_per_stage=spec["threads"])
    options["prefill_graph"] = "off" if spec["eager"] else "compiled"
    llm = LLM(model=spec["model"], **options)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)   # noqa: E731

    cpu: dict[int, list[float]] = {}

    def timed(n: int) -> float:
        t, c = time.perf_counter(), time.process_time()
        llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy(n), use_tqdm=False)
        cpu.setdefault(n, []).append(time.process_time() - c)
        return time.perf_counter() - t
    timed(8)
    n = spec["tokens"]
    ones = [timed(1) for _ in range(3)]
    best = (min(timed(1 + n) for _ in range(3)) - min(ones)) / n
    # CPU time per token (all threads, spinning included): at one thread, the work itself, little
    # changed by a busy machine's load
    out = {"ms": 1e3 * best, "cpu_ms": 1e3 * (min(cpu[1 + n]) - min(cpu[1])) / n, "threads": torch.get_num_threads(),
           "load": os.getloadavg()[0], "rss_mb": peak_rss_mb()}
    try:
        from stagewise.kernels import team  # jobs whose worker was descheduled (each began a backoff)
        out["late_jobs"] = team.late_jobs()
    except ImportError:
        pass
    llm.shutdown()
    return out


def llamacpp_worker(spec: dict) -> dict:
    import llama_cpp
    from llamacpp import without_extra_buffers
    without_extra_buffers(llama_cpp)   # ggml's AMX path segfaults on Q4_1 (workers/llamacpp.py)
    llm = llama_cpp.Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          n_ctx=1024, verbose=False)

    def timed(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        for i, _ in enumerate(llm.generate(PROMPT, top_k=1, temp=0.0, repeat_penalty=1.0)):
            if i + 1 >= n:
                break
        return time.perf_counter() - t
    timed(8)
    n = spec["tokens"]
    ones = [timed(1) for _ in range(3)]
    best = (min(timed(1 + n) for _ in range(3)) - min(ones)) / n
    return {"ms": 1e3 * best, "threads": spec["threads"], "load": os.getloadavg()[0],
            "rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it does not carry the parent's
    peak across exec)."""
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    fn = llamacpp_worker if spec["engine"] == "llama.cpp" else stagewise_worker
    print(MARK + json.dumps(fn(spec)), flush=True)
