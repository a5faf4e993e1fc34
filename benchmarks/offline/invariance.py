"""The cost of split-invariant attention (`invariant_attention`, i.e. `model.attention.INVARIANT`) on vs off.

One engine per dtype (a seeded tiny Llama with a 32k vocabulary: hidden 256, 4 layers, 4 heads / 2
KV heads, head size 64; float32, and bfloat16 where the split path takes the bf16 prefill kernel),
2 intra-op threads, prefix cache off (every round sees the same prompts). Each round runs every
measurement with the switch off and on (flipped in this process between generate calls), the
order alternating round by round (off-on, on-off, ...), so load drift hits both alike; the table
gives each side's median and best round, with the 1-minute load average of every round.

1. Offline throughput: N requests (default 32), prompts 16-256 and outputs 16-128 tokens (seeded).
2. Prefill latency: one fresh prompt of 512 and of 1024 tokens, max_tokens=1.
3. Batch-1 decode: one 16-token prompt, 128 output tokens, decode tok/s (plain decode steps take
   the same kernel either way: a check that nothing else moved).

    python -m benchmarks.offline invariance [--quick] [--rounds 4] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import machine_line, markdown_table, median, random_workload, temp_checkpoint, write_result

VOCAB = 32000


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def make_llm(model_dir, dtype: str, threads: int):
    from stagewise import LLM
    return LLM(model=str(model_dir), dtype=dtype, device="cpu", threads_per_stage=threads, max_num_seqs=64,
               kv_cache_memory="256MiB", max_model_len=2048, compile_in_background=False,
               enable_prefix_caching=False)


def _throughput(llm, prompts, out_lens) -> float:
    from stagewise import SamplingParams
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return sum(out_lens) / (time.perf_counter() - t0)


def _prefill_ms(llm, prompt) -> float:
    from stagewise import SamplingParams
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, ignore_eos=True,
                                                                           max_tokens=1), use_tqdm=False)
    return (time.perf_counter() - t0) * 1e3


def _decode_tps(llm, prompt, n: int) -> float:
    """Decode tok/s of one request: (n - 1) tokens over the time after the first one."""
    from stagewise import SamplingParams
    t1 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, ignore_eos=True,
                                                                           max_tokens=1), use_tqdm=False)
    t_first = time.perf_counter() - t1
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, ignore_eos=True,
                                                                           max_tokens=n), use_tqdm=False)
    return (n - 1) / max(time.perf_counter() - t0 - t_first, 1e-9)


def measure(llm, args) -> tuple[dict[str, dict[bool, list[float]]], list[str]]:
    from stagewise.model import attention
    prompts, out_lens = random_workload(args.num_requests, (16, args.max_prompt), (16, args.max_output), VOCAB,
                                        seed=1)
    long_prompts = {n: random_workload(1, (n, n), (1, 1), VOCAB, seed=100 + n)[0][0] for n in args.prefill_lens}
    short = random_workload(1, (16, 16), (1, 1), VOCAB, seed=7)[0][0]
    names = ["throughput tok/s", *(f"prefill {n} ms" for n in args.prefill_lens), "batch-1 decode tok/s"]
    res: dict[str, dict[bool, list[float]]] = {k: {False: [], True: []} for k in names}
    loads: list[str] = []
    _throughput(llm, *random_workload(4, (16, 64), (4, 8), VOCAB, seed=99))     # warm-up, both paths
    before = attention.INVARIANT
    try:
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                attention.INVARIANT = on
                res["throughput tok/s"][on].append(_throughput(llm, prompts, out_lens))
                for n, p in long_prompts.items():
                    res[f"prefill {n} ms"][on].append(_prefill_ms(llm, p))
                res["batch-1 decode tok/s"][on].append(_decode_tps(llm, short, args.decode_tokens))
            loads.append(_load())
            print(f"  round {r + 1}: load {loads[-1]}; " + "; ".join(
                f"{k} off {v[False][-1]:.1f} on {v[True][-1]:.1f}" for k, v in res.items()), flush=True)
    finally:
        attention.INVARIANT = before
    return res, loads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 2 rounds, short prompts")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    args.max_prompt, args.max_output, args.prefill_lens, args.decode_tokens = 256, 128, (512, 1024), 128
    if args.quick:
        args.num_requests, args.rounds, args.max_output, args.prefill_lens, args.decode_tokens = 8, 2, 32, (512,), 32
    torch.set_num_threads(args.threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    sections = []
    with temp_checkpoint(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048) as model_dir:
        for dtype in args.dtypes.split(","):
            print(f"{dtype}:", flush=True)
            llm = make_llm(model_dir, dtype, args.threads)
            try:
                res, loads = measure(llm, args)
            finally:
                llm.shutdown()
            rows = []
            for name, v in res.items():
                off, on = median(v[False]), median(v[True])
                rate = "tok/s" in name
                best = max if rate else min                                  # the least disturbed round
                cost = (off / on - 1) if rate else (on / off - 1)            # + = slower with INVARIANT on
                best_cost = (best(v[False]) / best(v[True]) - 1) if rate else (best(v[True]) / best(v[False]) - 1)
                rows.append([name, f"{off:.1f}", f"{on:.1f}", f"{cost * 100:+.1f}%", f"{best_cost * 100:+.1f}%",
                             " ".join(f"{x:.1f}" for x in v[False]), " ".join(f"{x:.1f}" for x in v[True])])
            sections += [f"## {dtype}", "", f"1-minute/5-minute load after each round: {', '.join(loads)}", "",
                         markdown_table(["measure", "off (median)", "on (median)", "cost (medians)",
                                         "cost (best rounds)", "off, each round", "on, each round"], rows), ""]
    text = "\n".join([
        "# Split-invariant attention: cost (`model.attention.INVARIANT` on vs off)", "",
        f"Tiny Llama (vocab {VOCAB}, hidden 256, 4 layers, 4 heads / 2 KV heads, head size 64), seeded "
        f"random weights; CPU {cpu}; {machine_line()}; {args.threads} intra-op threads; prefix cache off; "
        f"{args.rounds} interleaved rounds (off/on order alternating), medians. Throughput: "
        f"{args.num_requests} requests, prompts 16-{args.max_prompt}, outputs 16-{args.max_output}. "
        "Cost: how much slower the invariant path is (negative: faster), from the medians and from each "
        "side's best round (the least disturbed on a shared machine).", "",
        *sections,
        *(["_--quick smoke run: numbers not representative._"] if args.quick else []),
    ])
    print(text)
    print(f"\nwritten to {write_result('invariance-2026-12', text, args.quick)}")
    return 0
