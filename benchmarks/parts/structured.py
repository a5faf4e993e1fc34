"""Structured outputs' cost on the default model (SmolLM2-135M, 49,152-token vocabulary), side by
side in one process:

- first-request compile latency of a nested JSON schema (cold, then a cache hit), in the compile
  supervisor's process (grammar/), off the step loop;
- the per-step work the driver and the sampling stage add: bitmask fill (driver) + apply (last
  stage) for batch 1 and 32, every row constrained;
- end to end: decode ms/step of `LLM.generate` at batch 1 and 32, every row constrained (a regex
  that never ends, 64 tokens each) vs no row constrained, interleaved rounds.

    python -m benchmarks.parts structured [--rounds 3] [--tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import cpu_line, load_line, markdown_table, met, write_result

SCHEMA = {"type": "object", "properties": {
    "owner": {"type": "string"},
    "pets": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}}, "age": {"type": ["integer", "null"]}},
        "required": ["name", "color", "tags", "age"]}}}, "required": ["owner", "pets"]}
REGEX = "[a-z ,.]+"          # never complete: every row runs its full length


def compile_latency(llm) -> tuple[dict, object]:
    import json

    from stagewise.grammar.limits import GrammarLimits
    from stagewise.grammar.matchers import XGrammarBackend
    from stagewise.grammar.service import CompileService
    tok = llm.engine.tok
    t0 = time.perf_counter()
    backend = XGrammarBackend(tok.tokenizer, tok.vocab_size, tok.eos_token_ids)
    setup = time.perf_counter() - t0
    service = CompileService(lambda: backend, GrammarLimits())
    t0 = time.perf_counter()
    service.submit("", "regex", "[a-z]").future.result()
    start = time.perf_counter() - t0
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        service.submit("", "json", json.dumps(SCHEMA)).future.result()
        times.append(time.perf_counter() - t0)
    service.shutdown()
    return {"tokenizer set-up (once per engine)": setup, "compile supervisor start (once per engine)": start,
            "nested schema, first request": times[0], "same schema again (cache)": times[1]}, backend


def fill_apply(backend, batch: int, reps: int = 30) -> tuple[float, float]:
    """ms per step: bitmask fill of `batch` matchers (advanced into the JSON), and its apply."""
    import json

    import torch

    from stagewise.grammar.limits import GrammarLimits
    from stagewise.grammar.matchers import StructuredOutputManager
    from stagewise.plan import ScheduledSeq, StepPlan
    from stagewise.request import Request, SamplingParams
    from stagewise.runtime.sampler import apply_token_bitmask
    mgr = StructuredOutputManager(None, backend.vocab_size, (), GrammarLimits())
    mgr.service.backend = backend
    compiled = mgr.service.submit("", "json", json.dumps(SCHEMA)).future.result()
    for i in range(batch):
        mgr.matchers[f"r{i}"] = backend.matcher(compiled)
        mgr.requests[f"r{i}"] = Request(f"r{i}", [1], SamplingParams())
        mgr.json_rows.add(f"r{i}")
    plan = StepPlan(0, [ScheduledSeq(f"r{i}", 10, 1, True) for i in range(batch)])
    logits = torch.randn(batch, backend.vocab_size)
    fills, applies = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        mask = mgr.fill(plan)
        t1 = time.perf_counter()
        assert mask is not None
        apply_token_bitmask(logits, list(range(batch)), mask.bits)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
    mgr.shutdown()
    return 1e3 * statistics.median(fills), 1e3 * statistics.median(applies)


def decode_ms(llm, batch: int, tokens: int, constrained: bool) -> float:
    from stagewise import SamplingParams
    grammar = {"regex": REGEX} if constrained else None
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, structured_outputs=grammar)
    prompts = [f"Write about topic number {i}:" for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, structured_outputs=grammar), use_tqdm=False)  # compile
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return 1e3 * wall / tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from stagewise import LLM
    llm = LLM(prefill_graph="off")
    lat, backend = compile_latency(llm)
    lines = ["# Structured outputs: cost (`structured.py`)", "", cpu_line(), load_line(), ""]
    lines += [markdown_table(["compile", "ms"], [[k, f"{1e3 * v:.1f}"] for k, v in lat.items()]), ""]
    rows = []
    for batch in (1, 32):
        fill, apply = fill_apply(backend, batch)
        rows.append([batch, f"{fill:.2f}", f"{apply:.2f}"])
    lines += [markdown_table(["batch (all rows constrained)", "fill ms/step (driver)", "apply ms/step (last stage)"],
                             rows), ""]
    e2e = {}
    for r in range(args.rounds):
        for batch in (1, 32):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                e2e.setdefault((batch, constrained), []).append(decode_ms(llm, batch, args.tokens, constrained))
    rows = []
    for batch in (1, 32):
        free, con = statistics.median(e2e[(batch, False)]), statistics.median(e2e[(batch, True)])
        added = con / free - 1
        rows.append([batch, f"{free:.1f}", f"{con:.1f}", f"{100 * added:+.1f}%",
                     met(added, 0.10, higher_is_better=False) if batch == 32 else ""])
    lines += [markdown_table(["batch", "no row constrained ms/step", "every row constrained ms/step", "added",
                              "target <= 10% at 32"], rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    write_result("structured", text)
    llm.shutdown()
