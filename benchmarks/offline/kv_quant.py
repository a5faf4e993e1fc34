"""The quantized KV cache (`--kv-cache-dtype q8_0|q4_0`) against the model-dtype cache (bf16 by default).

One seeded random-weight Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, head size 64, a 32k
vocabulary), one engine per KV dtype, prefix cache off, measured in turn round by round:

1. KV bytes per token over all layers (the plan's figure; target: q8_0 <= 0.55x, q4_0 <= 0.3x of bf16).
2. Decode tok/s at a long context (default 4096 tokens): the wall time of `--decode` more output
   tokens after the same prompt's prefill (a max_tokens=1 request times the prefill alone);
   target: no slower than bf16.
3. Greedy agreement with the model-dtype cache on a fixed set of prompts: the share of positions
   with the same token and the mean |delta logprob| of the generated tokens before each prompt's
   first difference (as llama.cpp's perplexity comparison reports the KL of a quantized run).

    python -m benchmarks.offline kv-quant [--quick] [--rounds 3] [--context 4096] [--decode 64]
                                          [--dtype bfloat16] [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import machine_line, markdown_table, median, met, temp_checkpoint, write_result

KV_DTYPES = ("auto", "q8_0", "q4_0")
VOCAB = 32000


def make_llm(model_dir, dtype: str, kv: str, threads: int, context: int):
    from stagewise import LLM
    return LLM(model=str(model_dir), dtype=dtype, device="cpu", threads_per_stage=threads, kv_cache_dtype=kv,
               max_model_len=context + 256, kv_cache_memory="512MiB", enable_prefix_caching=False,
               compile_in_background=False)


def bytes_per_token(kv: str, dtype: str) -> int:
    import torch

    from stagewise.kernels.kv_quant import row_bytes
    layers, kv_heads, head_dim = 4, 2, 64
    return 2 * layers * kv_heads * row_bytes(kv, head_dim, getattr(torch, dtype))


def decode_speed(llm, prompt: list[int], decode: int) -> float:
    from stagewise import SamplingParams
    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=n, temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start
    prefill = run(1)
    return decode / max(1e-9, run(decode + 1) - prefill)


def greedy(llm, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]]:
    from stagewise import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def agreement(ref, got) -> tuple[float, float]:
    same = total = 0
    deltas: list[float] = []
    for (ta, la), (tb, lb) in zip(ref, got):
        total += len(ta)
        same += sum(a == b for a, b in zip(ta, tb))
        shared = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        deltas += [abs(la[i] - lb[i]) for i in range(shared)]
    return same / max(1, total), sum(deltas) / max(1, len(deltas))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings: a check that the benchmark runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt of the agreement set")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.context, args.decode, args.prompts, args.tokens = 1, 256, 8, 2, 8
    rng = random.Random(0)
    long_prompt = [rng.randrange(3, 1024) for _ in range(args.context)]
    fixed = [[rng.randrange(3, 1024) for _ in range(rng.randrange(32, 256))] for _ in range(args.prompts)]
    speeds: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    answers = {}
    with temp_checkpoint(vocab_size=VOCAB, max_position_embeddings=args.context + 256) as model_dir:
        llms = {kv: make_llm(model_dir, args.dtype, kv, args.threads, args.context) for kv in KV_DTYPES}
        try:
            for kv, llm in llms.items():
                answers[kv] = greedy(llm, fixed, args.tokens)
            for r in range(args.rounds):
                for kv in (KV_DTYPES if r % 2 == 0 else KV_DTYPES[::-1]):     # alternate the order: load drift
                    speeds[kv].append(decode_speed(llms[kv], long_prompt, args.decode))
        finally:
            for llm in llms.values():
                llm.shutdown()
    base_bytes, base_speed = bytes_per_token("bf16", args.dtype), median(speeds["auto"])
    rows = []
    for kv in KV_DTYPES:
        same, delta = agreement(answers["auto"], answers[kv])
        ratio = bytes_per_token(kv, args.dtype) / base_bytes
        target = {"q8_0": 0.55, "q4_0": 0.3}.get(kv)
        speed = median(speeds[kv])
        rows.append([kv, bytes_per_token(kv, args.dtype), f"{ratio:.2f}x" + (f" ({met(ratio, target, False)})"
                     if target else ""), f"{speed:.1f}", f"{speed / base_speed:.2f}x" + (
                     f" ({met(speed / base_speed, 1.0)})" if kv != "auto" else ""), f"{100 * same:.0f}%", delta])
    text = (f"# Quantized KV cache\n\n{machine_line()}\n\nmodel dtype {args.dtype}, context {args.context}, "
            f"{args.decode} decode tokens, {args.rounds} round(s), {args.threads} threads; agreement over "
            f"{args.prompts} prompts x {args.tokens} greedy tokens against the {args.dtype} cache\n\n"
            + markdown_table(["kv cache", "bytes/token", "vs bf16", "decode tok/s", "vs auto",
                              "same tokens", "mean |dlogprob|"], rows))
    print(text)
    print(f"wrote {write_result('kv-quant', text, quick=args.quick)}")
