"""What a kernel op costs around its kernel: the ops registered in C++ (kernels/csrc/*_ops.cpp, the
default where a C++ compiler works) against registered in Python (ctypes behind a Python function,
the fallback), in one process, the two swapped round by round (a Python override made and
destroyed), so the load of a shared machine falls on both alike.

- per call, one row, the default model's shapes (SmolLM2-135M: hidden 576, 9 query and 3 KV
  heads of 64, MLP 1536), float32 packed weights (bf16 where the CPU has native bf16): the C
  kernel alone through ctypes, the Python implementation called directly, and `torch.ops` (what
  Inductor's generated code calls) with either registration; a 32 x 8 weight shows the overhead
  alone. Decode attention of one sequence of 256 keys likewise;
- batch-1 decode of the default model with `--prefill-graph compiled`, ms per token, wall and
  process CPU time (the latter less sensitive to a busy machine).

    python -m benchmarks.kernels dispatch [--rounds 5] [--threads 1] [--no-decode]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch

from benchmarks.common import cpu_line, load_line, markdown_table, random_workload, write_result

HIDDEN, INTER, HQ, HKV, D = 576, 1536, 9, 3, 64
SHAPES = {"qkv 960x576": (HQ * D + 2 * HKV * D, HIDDEN), "o 576x576": (HIDDEN, HQ * D),
          "gate/up 3072x576": (2 * INTER, HIDDEN), "down 576x1536": (HIDDEN, INTER), "tiny 32x8": (32, 8)}


@contextlib.contextmanager
def python_registration():
    """The ops' CPU kernels and the eager wrappers as they are where csrc/*_ops.cpp did not build."""
    from stagewise.kernels import attention, gemm, native
    saved = dict(native._loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "overriding a previously registered kernel"
        lib = torch.library.Library("stagewise", "IMPL")
        for name, fn in (("linear", gemm._by_rows), ("linear_packed", gemm._packed),
                         ("decode_attention", attention._decode), ("prefill_attention", attention._prefill)):
            lib.impl(name, fn, "CPU")
    native._loaded.update({name: None for name in saved})
    try:
        yield
    finally:
        lib._destroy()
        native._loaded.update(saved)


def per_call_us(fn, calls: int = 400) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def call_table(rounds: int) -> list[list]:
    from stagewise.kernels import attention, gemm
    from stagewise.kernels.build import native_bf16
    dtype = torch.bfloat16 if native_bf16() else torch.float32
    lib = gemm._load()
    cases = {}
    for name, (n, k) in SHAPES.items():
        w, x = gemm.pack(torch.randn(n, k).to(dtype)), torch.randn(1, k).to(dtype)
        y = torch.empty(1, n, dtype=dtype)
        if dtype == torch.bfloat16:
            kernel = (lambda x=x, w=w, y=y, n=n, k=k:
                      lib.packed_linear_bf16(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), None, n, 1, n, k))
        else:
            kernel = (lambda x=x, w=w, y=y, n=n, k=k:
                      lib.packed_linear_f32(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, 1, n, k))
        cases[f"linear_packed {name}"] = (kernel, lambda x=x, w=w: gemm._packed(x, w, None),
                                          lambda x=x, w=w: torch.ops.stagewise.linear_packed.default(x, w, None, False))
    cache = torch.randn(2, 64, 16, HKV, D).to(dtype)
    q, tables, lens = torch.randn(1, HQ, D).to(dtype), torch.arange(1, 17)[None], torch.tensor([256])
    alib = attention._load()
    fn = getattr(alib, "decode_attention16_bf16" if dtype == torch.bfloat16 else "decode_attention16_f32")
    out = torch.empty(1, HQ, D, dtype=dtype)
    cases["decode_attention 256 keys"] = (
        lambda: fn(q.data_ptr(), HQ * D, cache[0].data_ptr(), cache[1].data_ptr(), 16 * HKV * D, 64, tables.data_ptr(),
                   16, 16, lens.data_ptr(), 1, HQ, HKV, D, 16, 0.125, 1, out.data_ptr()),
        lambda: attention._decode(q, cache, tables, lens, 0.125),
        lambda: torch.ops.stagewise.decode_attention.default(q, cache, tables, lens, 0.125, None))
    times: dict[str, dict[str, list[float]]] = {c: {"kernel": [], "python fn": [], "op: C++": [], "op: Python": []}
                                                 for c in cases}
    for _ in range(rounds):
        for case, (kernel, python_fn, op) in cases.items():
            times[case]["kernel"].append(per_call_us(kernel))
            times[case]["python fn"].append(per_call_us(python_fn))
            times[case]["op: C++"].append(per_call_us(op))
            with python_registration():
                times[case]["op: Python"].append(per_call_us(op))
    rows = []
    for case, t in times.items():
        best = {k: min(v) for k, v in t.items()}
        rows.append([case, *(f"{best[k]:.1f}" for k in ("kernel", "python fn", "op: Python", "op: C++")),
                     f"{best['op: Python'] - best['op: C++']:.1f}"])
    return rows


def decode_table(rounds: int, threads: int | None) -> list[list]:
    from stagewise import LLM, SamplingParams
    llm = LLM(model=None, prefill_graph="compiled", kv_cache_memory="1GiB", max_model_len=2048,
              enable_prefix_caching=False, threads_per_stage=threads, compile_in_background=False)
    fresh = iter(random_workload(200, (32, 32), (1, 1), 49152, seed=7)[0])

    def per_token(steps: int = 48) -> tuple[float, float]:
        def gen(n):
            t0, c0 = time.perf_counter(), time.process_time()
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            llm.generate(prompt_token_ids=[next(fresh)], sampling_params=params, use_tqdm=False)
            return time.perf_counter() - t0, time.process_time() - c0
        (w1, c1), (wn, cn) = gen(1), gen(1 + steps)
        return 1e3 * (wn - w1) / steps, 1e3 * (cn - c1) / steps

    res: dict[str, list[tuple[float, float]]] = {"Python": [], "C++": []}
    for r in range(rounds):
        for config in (("C++", "Python") if r % 2 else ("Python", "C++")):
            with python_registration() if config == "Python" else contextlib.nullcontext():
                res[config].append(per_token())
        print(f"decode round {r + 1}: Python {res['Python'][-1]} ms, C++ {res['C++'][-1]} ms", flush=True)
    rows = []
    for k, v in res.items():
        wall, cpu = statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)
        ref = statistics.median(t[1] for t in res["Python"])
        rows.append([k, f"{wall:.2f}", f"{min(t[0] for t in v):.2f}", f"{cpu:.2f}", f"{cpu / ref:.2f}x"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the per-call table")
    ap.add_argument("--no-decode", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = ["# Kernel op dispatch: C++ against Python registration\n",
             f"CPU: {cpu_line()}; torch {torch.__version__}; {load_line()}.\n",
             f"## Per call, one row, {args.threads} thread(s) (us, best of {args.rounds} rounds)\n",
             markdown_table(["call", "C kernel (ctypes)", "Python fn direct", "torch.ops, Python registration",
                             "torch.ops, C++ registration", "saved per call"], call_table(args.rounds)) + "\n"]
    if not args.no_decode:
        parts += [f"## Batch-1 decode, default model, compiled, {args.threads} thread(s) (ms per token: wall "
                  "median and best of rounds, process CPU time median)\n",
                  markdown_table(["registration", "wall median", "wall best", "CPU median", "CPU vs Python"],
                                 decode_table(args.rounds, args.threads)) + "\n"]
    text = "\n".join(parts)
    print(text)
    print(f"written to {write_result('kernel-dispatch', text)}")
    return 0
