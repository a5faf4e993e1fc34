"""Quantized linear kernels side by side on 1B-class shapes (Llama-3.2-1B: hidden 2048, MLP 8192,
vocab 49,152 for the tied head), at 1, 4, 32 and 512 rows:

- ours (`kernels.quant.linear`, packed weights) for every GGUF type, in the fast mode (int8
  activations, integer dot products) and, for Q4_0 and Q8_0, the exact mode (float32 activations);
- `F.linear` on bf16 and on float32 weights;
- PyTorch's own weight-only kernels: `_weight_int8pack_mm` (per-channel int8) and
  `_weight_int4pack_mm_for_cpu` (group-32 int4 with bf16 scales and zeros), bf16 activations.

At 1 and 4 rows every call reads a different copy of the weights (copies past the L3 cache), as a
decode step streams a model's weights from memory: the table gives GB/s of the weights' bytes as
stored by each method. At 32 and 512 rows it gives GFLOP/s. Activations are bf16 (the engine's
dtype) except for the float32 baseline.

    python -m benchmarks.kernels quant-kernels [--threads 2] [--rounds 3] [--clock cpu] [--quick] [--variant avx2]

`--clock cpu` times a one-thread run by its CPU time, which a busy shared machine disturbs less.
`--variant` runs our kernels from another instruction-set build (`avx512` without VNNI, `avx2`,
`portable`: what an AVX2-only machine or a machine without either runs) instead of the native one.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES

from benchmarks.common import cpu_line, load_line, markdown_table, write_result
from stagewise.kernels import quant, quant_kernels
from stagewise.kernels.quant import QuantizedWeight, T

SHAPES = {"attn q/o 2048x2048": (2048, 2048), "mlp gate/up 8192x2048": (8192, 2048),
          "mlp down 2048x8192": (2048, 8192), "head 49152x2048": (49152, 2048)}
ROWS = (1, 4, 32, 512)
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
STREAM_BYTES = 600e6        # past the L3 cache of the machines at hand (260 MB)


def _random_blocks(qtype: T, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Speed does not depend on the values: random codes with small finite fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=gen)
    scale = torch.full((n, k // block), 0.001, dtype=torch.float16).unsqueeze(-1).view(torch.uint8)
    for at in ((208,) if qtype == T.Q6_K else (0, 2) if qtype not in (T.Q4_0, T.Q5_0, T.Q8_0) else (0,)):
        data[..., at:at + 2] = scale
    return QuantizedWeight.from_gguf(data.reshape(n, -1), qtype, (n, k))


class Clock:
    def __init__(self, kind: str, rounds: int):
        self.now = time.process_time if kind == "cpu" else time.perf_counter
        self.rounds = rounds

    def per_call(self, fn, operands: list) -> float:
        """Best over rounds of the mean seconds per call, one call per operand (copies stream)."""
        fn(operands[0])
        best = float("inf")
        for _ in range(self.rounds):
            t0 = self.now()
            for op in operands:
                fn(op)
            best = min(best, (self.now() - t0) / len(operands))
        return best


def _copies(make, nbytes: int, rows: int) -> list:
    return [make() for _ in range(max(1, int(STREAM_BYTES // nbytes)) if rows <= 4 else 1)]


def _ours(variant: str, exact: bool):
    """Our kernel: the op (as the engine calls it), or the library of another build."""
    if variant == "native":
        return lambda x, w: quant.linear(x, w, exact=exact)
    return lambda x, w: quant_kernels.run_linear(x, w.data, None, int(w.qtype), w.shape[0], exact, False, variant)


def _methods(n: int, k: int, gen: torch.Generator, variant: str = "native"):
    """(name, bytes of one weight, factory of one weight, fn(x_bf16, weight))."""
    out = []
    tag = "" if variant == "native" else f" [{variant}]"
    for qtype in TYPES:
        w = _random_blocks(qtype, n, k, gen).pack()
        copy = lambda w=w: QuantizedWeight(w.qtype, w.shape, w.data.clone(), True)
        out.append((f"ours {qtype.name}{tag}", w.nbytes, copy, _ours(variant, False)))
        if qtype in (T.Q4_0, T.Q8_0):
            out.append((f"ours {qtype.name} exact{tag}", w.nbytes, copy, _ours(variant, True)))
    out.append(("F.linear bf16", n * k * 2, lambda: torch.randn(n, k, generator=gen).bfloat16(),
                lambda x, w: F.linear(x, w)))
    out.append(("F.linear fp32", n * k * 4, lambda: torch.randn(n, k, generator=gen),
                lambda x, w: F.linear(x.float(), w)))
    out.append(("torch int8pack", n * k + n * 2,
                lambda: (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n).bfloat16()),
                lambda x, w: torch.ops.aten._weight_int8pack_mm(x, *w)))
    groups = torch.zeros(k // 32, n, 2, dtype=torch.bfloat16)
    out.append(("torch int4pack g32", n * k // 2 + groups.numel() * 2,
                lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1),
                lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, groups)))
    return out


def shape_table(n: int, k: int, clock: Clock, rows: tuple[int, ...], variant: str = "native") -> list[list]:
    gen = torch.Generator().manual_seed(0)
    table = []
    for name, nbytes, make, fn in _methods(n, k, gen, variant):
        row: list = [name, f"{nbytes / 1e6:.1f}"]
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            seconds = clock.per_call(lambda w, fn=fn, x=x: fn(x, w), _copies(make, nbytes, m))
            rate = f"{nbytes / seconds / 1e9:.1f} GB/s" if m <= 4 else f"{2 * m * n * k / seconds / 1e9:.0f} GFLOP/s"
            row.append(f"{seconds * 1e3:.2f} ms, {rate}")
        table.append(row)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--quick", action="store_true", help="the 2048x2048 shape only, one round")
    ap.add_argument("--variant", choices=tuple(quant_kernels.VARIANTS), default="native",
                    help="the instruction-set build of our kernels")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread")
    if not quant_kernels.variant_runs_here(args.variant):
        ap.error(f"this CPU cannot run the {args.variant} build")
    torch.set_num_threads(args.threads)
    clock = Clock(args.clock, 1 if args.quick else args.rounds)
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    parts = [f"# Quantized linear kernels, {args.threads} thread(s), {args.clock} clock\n",
             f"CPU: {cpu_line()}; torch {torch.__version__}; our kernels: the {args.variant} build "
             f"({quant_kernels.library(args.variant).quant_isa().decode()}); {load_line()} at the start.\n"]
    for title, (n, k) in shapes.items():
        parts.append(f"## {title} (ms per call; 1-4 rows: GB/s of the stored weight, 32-512: GFLOP/s)\n")
        parts.append(markdown_table(["method", "weight MB", *[f"{m} rows" for m in ROWS]],
                                    shape_table(n, k, clock, ROWS, args.variant)) + "\n")
        print(parts[-1], flush=True)
    parts.append(f"{load_line()} at the end.\n")
    text = "\n".join(parts)
    name = f"quant-kernels-{args.threads}thread" + ("" if args.variant == "native" else f"-{args.variant}")
    print(f"written to {write_result(name, text, quick=args.quick)}")
    return 0
