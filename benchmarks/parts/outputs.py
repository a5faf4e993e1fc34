"""Per-step output overhead of the engine: detokenization and stop-string checks for 64 requests
decoding 1,024 tokens each with 4 stop strings, before (re-decode the whole output and search it
every step) and after (incremental decode of a small window, stop strings searched in the new
tail only). No model runs: the step's sampled tokens are replayed from real text, so the table
isolates the per-step driver work that grows with output length.

    python -m benchmarks.parts outputs [--requests 64] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

from benchmarks.common import load_line, markdown_table, write_result
from stagewise.engine.inputs import Tokenizer
from stagewise.engine.outputs import finish_check
from stagewise.model.demo import _corpus, build_demo_model
from stagewise.request import FinishReason, Request, SamplingParams

STOPS = ["<END OF STORY>", "\n\n\n\n", "Q: Q: Q:", "###"]   # never produced: every step searches them all


def finish_check_before(req: Request, tok, max_model_len: int):
    """The previous algorithm, kept as the baseline: decode everything, search everything."""
    p = req.params
    full = tok.decode(req.output_token_ids, p.skip_special_tokens)
    hits = [i for i in (full.find(s) for s in p.stop) if i >= 0]
    if hits:
        req.text = full[:min(hits)]
        return FinishReason.STOP
    best = 0
    for s in p.stop:
        for k in range(min(len(s) - 1, len(full)), best, -1):
            if full.endswith(s[:k]):
                best = k
                break
    req.text = full[:len(full) - best]
    return FinishReason.LENGTH if len(req.output_token_ids) >= p.max_tokens else None


def run(check, tok, streams: list[list[int]], marks: tuple[int, ...]) -> dict[int, float]:
    """Mean ms per engine step (all requests) over each window ending at a mark."""
    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=len(s), stop=STOPS)) for i, s in enumerate(streams)]
    out, t_window, start = {}, 0.0, 0
    for step in range(len(streams[0])):
        t0 = time.perf_counter()
        for req, stream in zip(reqs, streams):
            req.output_token_ids.append(stream[step])
            check(req, tok, 10**6)
        t_window += time.perf_counter() - t0
        if step + 1 in marks:
            out[step + 1] = 1000 * t_window / (step + 1 - start)
            t_window, start = 0.0, step + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer(str(build_demo_model(d)))
    ids = tok.encode(_corpus())
    rng = random.Random(0)
    streams = []
    for _ in range(args.requests):
        at = rng.randrange(len(ids) - args.tokens)
        streams.append(ids[at:at + args.tokens])
    marks = tuple(m for m in (64, 256, 512, args.tokens) if m <= args.tokens)
    before = run(finish_check_before, tok, streams, marks)
    after = run(finish_check, tok, streams, marks)
    rows = [[f"{m}", f"{before[m]:.2f}", f"{after[m]:.2f}", f"{before[m] / after[m]:.1f}x"] for m in marks]
    table = markdown_table(["steps (window end)", "before ms/step", "after ms/step", "before / after"], rows)
    path = write_result("output_overhead", f"# Output overhead per engine step\n\n{args.requests} requests x "
                        f"{args.tokens} tokens, 4 stop strings never produced; ms per engine step spent on "
                        f"detokenization and stop checks, mean over the steps since the previous row ({load_line()})."
                        f"\n\n{table}")
    print(path.read_text())
