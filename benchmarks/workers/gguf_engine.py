"""One engine on one GGUF file in its own process, for benchmarks/quantized/bench.py: stagewise (its public
`LLM` API), llama.cpp (llama-cpp-python) or HF transformers (its GGUF loader: the fp32 dequantized
reference) loads the model once, then times greedy generation on the spec's token-id prompts, or
scores a text (per-token log-probabilities), and writes JSON. It runs under each engine's own
Python, so only the standard library is imported at the top.

    PYTHON benchmarks/workers/gguf_engine.py SPEC.json OUT.json
"""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


class Stagewise:
    def __init__(self, spec: dict):
        from stagewise import LLM, SamplingParams
        self.SamplingParams = SamplingParams
        self.llm = LLM(model=spec["model"], dtype=spec["dtype"], device="cpu", threads_per_stage=spec["threads"],
                       kv_cache_memory=spec["kv_cache"], max_model_len=spec["max_model_len"], max_num_seqs=64,
                       compile_in_background=False)      # steady state: load includes the compile

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        params = self.SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def logprobs(self, tokens: list[int]) -> list[float]:
        """log p(token i | tokens before i) for i >= 1."""
        params = self.SamplingParams(max_tokens=0, prompt_logprobs=0)
        out = self.llm.generate(prompt_token_ids=[tokens], sampling_params=params, use_tqdm=False)[0]
        return [e.logprob for e in out.prompt_logprobs[1:]]


class LlamaCpp:
    """The Python binding runs one sequence at a time (no batched multi-request API)."""

    def __init__(self, spec: dict):
        import llama_cpp
        if spec.get("no_extra_bufts"):    # off only where asked: the repack buffers speed up prefill
            from llamacpp import without_extra_buffers
            without_extra_buffers(llama_cpp)
        self.llm = llama_cpp.Llama(model_path=spec["model"], n_threads=spec["threads"],
                                   n_threads_batch=spec["threads"], n_ctx=spec["max_model_len"], verbose=False,
                                   seed=0, logits_all=bool(spec.get("logprobs")))
        self.info = {"version": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode().strip()}

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from llamacpp import greedy
        return greedy(self.llm, prompts, n)

    def logprobs(self, tokens: list[int]) -> list[float]:
        import numpy as np
        self.llm.reset()
        self.llm.eval(tokens)
        logits = np.asarray(self.llm.scores[: len(tokens) - 1], dtype=np.float64)
        peak = logits.max(axis=1, keepdims=True)
        logz = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
        return (logits[np.arange(len(tokens) - 1), tokens[1:]] - logz).tolist()


class HFReference:
    """transformers' GGUF loader dequantizes every tensor to fp32 (gguf-py's numpy dequantizers):
    an implementation independent of both engines. Scoring only."""

    def __init__(self, spec: dict):
        import torch
        import transformers
        torch.set_num_threads(spec["threads"])
        path = Path(spec["model"])
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    def logprobs(self, tokens: list[int]) -> list[float]:
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(torch.tensor([tokens])).logits[0, :-1].double()
            lp = torch.log_softmax(logits, dim=-1)
        return lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].tolist()


ENGINES = {"stagewise": Stagewise, "llamacpp": LlamaCpp, "hf": HFReference}
# Imported before the baseline RSS is read, so that "what loading added" holds the model, not the libraries.
MODULES = {"stagewise": ("torch", "torch._inductor.compile_fx", "stagewise"), "llamacpp": ("llama_cpp",),
           "hf": ("torch", "transformers")}


def _status_mib(pid: int | str, field: str) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":"))) / 1024


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: exec keeps the forked parent's high-water mark."""
    return _status_mib("self", "VmHWM")


def tree_rss_mib() -> float:
    """Resident memory of this process and all its descendants, from /proc (no psutil in every venv)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        kids = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(kids)
        frontier += kids
    total = 0.0
    for pid in tree:
        try:
            total += _status_mib(pid, "VmRSS")
        except (OSError, StopIteration):
            continue
    return total


def timed(engine, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    out = engine.generate(prompts, n)
    wall = time.perf_counter() - t0
    if [len(o) for o in out] != [n] * len(prompts):
        raise RuntimeError(f"expected {n} tokens per request, got {[len(o) for o in out]}")
    return wall


def measure(engine, spec: dict) -> dict:
    res: dict = {}
    if "logprobs" in spec:
        t0 = time.perf_counter()
        res["logprobs"] = engine.logprobs(spec["logprobs"])
        res["score_s"] = time.perf_counter() - t0
        if not all(math.isfinite(v) for v in res["logprobs"]):
            raise RuntimeError("non-finite log-probabilities")
    if "greedy" in spec:
        res["greedy"] = [engine.generate([p], spec["greedy_tokens"])[0] for p in spec["greedy"]]
    if "warmup" in spec:
        timed(engine, spec["warmup"], 4)
    if "throughput" in spec:
        prompts, n = spec["throughput"]
        res["throughput"] = {"wall_s": timed(engine, prompts, n), "output_tokens": n * len(prompts)}
    if "ttft" in spec:                                  # the first prompt is a warm-up
        res["ttft_ms"] = [timed(engine, [p], 1) * 1e3 for p in spec["ttft"]][1:]
    if "decode" in spec:                                # (best 1+n tokens - best 1 token) / n, fresh prompts
        d = spec["decode"]
        t_first = min(timed(engine, [p], 1) for p in d["first"])
        t_long = min(timed(engine, [p], 1 + d["n"]) for p in d["long"])
        res["decode_ms"] = (t_long - t_first) / d["n"] * 1e3
    return res


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for module in MODULES[spec["engine"]]:
        importlib.import_module(module)
    before = tree_rss_mib()
    t0 = time.perf_counter()
    engine = ENGINES[spec["engine"]](spec)
    res: dict[str, Any] = {"load_s": time.perf_counter() - t0, "rss_before_load_mib": before,
                           "rss_after_load_mib": tree_rss_mib(), "peak_after_load_mib": peak_rss_mib()}
    res.update(measure(engine, spec), info=getattr(engine, "info", None))
    res["self_peak_rss_mib"] = peak_rss_mib()
    tmp = out_path + ".tmp"
    Path(tmp).write_text(json.dumps(res))
    os.replace(tmp, out_path)
    sys.stdout.flush()
    os._exit(0)      # no engine shutdown: the caller kills the process tree by pid


if __name__ == "__main__":
    main(*sys.argv[1:3])
