"""The CPU kernels side by side, on the default model's shapes (SmolLM2-135M: hidden 576, 9 query
and 3 KV heads of 64, MLP 1536, 30 layers), in one process, one configuration after another per
round (best of the rounds kept), weights streamed from memory as in a real step:

- linear layers: every layer's four weight matrices (fused qkv, o, fused gate/up, down) at 1 to 512
  rows: the unpacked path (`kernels.gemm.linear`: the small-row kernel, then MKL/oneDNN), oneDNN's own
  prepacked linear (`mkldnn._linear_pointwise`, weights reordered for 32 rows), and the packed
  kernel (`kernels.gemm.linear_packed`), for bf16 (where the CPU has native bf16) and float32;
- decode attention at batch 32 over contexts of 150-320 tokens, 30 layers;
- causal prefill attention (bf16 kernel against SDPA) at 64, 200 and 512 tokens.

    python -m benchmarks.kernels cpu-kernels [--threads 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from benchmarks.common import cpu_line, markdown_table, write_result

HIDDEN, INTER, HQ, HKV, D, LAYERS = 576, 1536, 9, 3, 64, 30
SHAPES = [(HQ * D + 2 * HKV * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
ROWS = (1, 2, 4, 8, 16, 32, 64, 200, 512)


def best_ms(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _linear_ms(xs: dict, weights: list, onednn: list | None, packed: list | None, rounds: int) -> dict[str, float]:
    from stagewise.kernels import gemm as cpu_gemm
    runs = {"unpacked": lambda: [cpu_gemm.linear(xs[w.shape[1]], w) for w in weights]}
    if onednn is not None:
        runs["oneDNN prepacked"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                            for w, p in zip(weights, onednn)]
    if packed is not None:
        runs["packed"] = lambda: [cpu_gemm.linear_packed(xs[w.shape[1]], w) for w in packed]
    return {name: best_ms(fn, rounds) for name, fn in runs.items()}


def linear_rows(dtype: torch.dtype, rounds: int) -> list[list]:
    from stagewise.kernels import gemm as cpu_gemm
    weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    packed = [cpu_gemm.pack(w) for w in weights] if cpu_gemm.packable(weights[0]) else None
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights] if dtype == torch.bfloat16 else None
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows = []
    for m in ROWS:
        ms = _linear_ms({k: torch.randn(m, k).to(dtype) for k in (HIDDEN, INTER)}, weights, onednn, packed, rounds)
        row: list = [m, f"{ms['unpacked']:.1f}"]
        for name in ("oneDNN prepacked", "packed"):
            row.append(f"{ms[name]:.1f} ({ms[name] / ms['unpacked']:.2f}x)" if name in ms else "n/a")
        row.append(f"{flops_per_row * m / (min(ms.values()) / 1e3) / 1e9:.0f}")
        rows.append(row)
    return rows


def decode_attention_ms(rounds: int) -> float:
    from stagewise.kernels import attention as cpu_attention
    rng = random.Random(0)
    g = 32
    lens = [rng.randint(150, 320) for _ in range(g)]
    nblk = max((n + 15) // 16 for n in lens)
    caches = [torch.randn(2, g * nblk + 1, 16, HKV, D).bfloat16() for _ in range(LAYERS)]
    ids = list(range(1, g * nblk + 1))
    rng.shuffle(ids)
    tables = torch.tensor([ids[i * nblk:(i + 1) * nblk] for i in range(g)])
    seq_lens, q = torch.tensor(lens), torch.randn(g, HQ, D).bfloat16()
    return best_ms(lambda: [cpu_attention.decode_attention(q, c, tables, seq_lens, D ** -0.5) for c in caches], rounds)


def _prefill_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rounds: int) -> tuple[float, float | None]:
    from stagewise.kernels import attention as cpu_attention
    qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, k, v))
    sdpa = best_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=D ** -0.5, enable_gqa=True),
                   rounds)
    if not cpu_attention.prefill_supports(q, k):
        return sdpa, None
    return sdpa, best_ms(lambda: cpu_attention.prefill_attention(q, k, v, D ** -0.5), rounds)


def prefill_rows(rounds: int) -> list[list]:
    rows = []
    for n in (64, 200, 512):
        q, k, v = (torch.randn(n, h, D).bfloat16() for h in (HQ, HKV, HKV))
        sdpa, kern = _prefill_ms(q, k, v, rounds * 5)
        rows.append([n, f"{sdpa:.2f}", "n/a (no AVX512-BF16)" if kern is None else f"{kern:.2f} ({kern / sdpa:.2f}x)"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = [f"# CPU kernels, {args.threads} thread(s)\n", f"CPU: {cpu_line()}; torch {torch.__version__}.\n"]
    for dtype in (torch.bfloat16, torch.float32):
        parts.append(f"## Linear layers, {str(dtype)[6:]} (30 layers x 4 matrices, ms per step; ratio to unpacked)\n")
        parts.append(markdown_table(["rows", "unpacked ms", "oneDNN prepacked", "packed", "best GFLOP/s"],
                                    linear_rows(dtype, args.rounds)) + "\n")
    parts.append("## Decode attention, bf16, batch 32, contexts 150-320, 30 layers\n")
    parts.append(f"{decode_attention_ms(args.rounds):.1f} ms per step\n")
    parts.append("## Causal prefill attention, bf16, one layer (ms; ratio to SDPA)\n")
    parts.append(markdown_table(["tokens", "SDPA ms", "kernel"], prefill_rows(args.rounds)) + "\n")
    text = "\n".join(parts)
    print(text)
    print(f"written to {write_result(f'cpu-kernels-{args.threads}thread', text)}")
    return 0
