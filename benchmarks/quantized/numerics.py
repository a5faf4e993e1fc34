"""The numerics half of benchmarks/quantized/bench.py: the same ~2,000 tokens of real text (the Python
license that ships with the standard library) scored on each file by the fp32 reference
(transformers' GGUF loader dequantizes the file; independent of both engines), by stagewise at its
default dtype and at float32, and by llama.cpp (`logits_all=True`); mean absolute differences of the
per-token log-probabilities and perplexities against the issue's targets.
"""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path

from benchmarks.common import cpu_line, markdown_table

LP_TARGET_NATS, PPL_TARGET = 0.02, 0.01
PROMPT = "The capital of France is"


def run(args, files: dict, tmp: Path, run_worker) -> dict:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(files["tokenizer"])
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    tokens = tok(text).input_ids[: args.numerics_tokens]
    out: dict = {"text": "the standard library's LICENSE.txt (first tokens)", "tokens": len(tokens), "files": {}}
    threads = max(args.threads)
    for key in args.numerics_files:
        base = dict(file=key, threads=threads, kind="numerics", model=str(files[key]), max_model_len=2048,
                    kv_cache="256MiB", logprobs=tokens)
        runs = {"reference": dict(base, engine="hf"),
                "stagewise auto": dict(base, engine="stagewise", dtype="auto"),
                "stagewise float32": dict(base, engine="stagewise", dtype="float32"),
                "llama.cpp": dict(base, engine="llamacpp", no_extra_bufts="amx" in cpu_line())}
        if key == "smollm2":             # the default model still answers "Paris"
            for name in ("stagewise auto", "llama.cpp"):
                runs[name].update(greedy=[tok(PROMPT).input_ids], greedy_tokens=8)
        out["files"][key] = {}
        for name, spec in runs.items():
            if spec["engine"] in ("stagewise", "llamacpp") and spec["engine"] not in args.engines:
                continue
            print(f"[numerics] {name} on {key} ...", flush=True)
            res = run_worker(args, spec, tmp, f"num-{key}-{name.replace(' ', '_')}")
            print("    " + (res["error"] if "error" in res else f"scored in {res['score_s']:.1f} s"), flush=True)
            if "greedy" in res:
                res["greedy_text"] = tok.decode(res["greedy"][0])
            out["files"][key][name] = res
    return out


def _ppl(lp: list[float]) -> float:
    return math.exp(-sum(lp) / len(lp))


def _diff(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return sum(d) / len(d), max(d)


def section(numerics: dict, meta: dict) -> list[str]:
    rows, ppl_rows, greedy, failed = [], [], [], []
    for key, runs in numerics["files"].items():
        ok = {n: r for n, r in runs.items() if "error" not in r}
        failed += [f"**{n} on {key} failed**: {r['error']}\n\n```\n{r.get('log_tail', '')[-800:].strip()}\n```"
                   for n, r in runs.items() if "error" in r]
        ref = ok.get("reference")
        for name in ("stagewise auto", "stagewise float32", "llama.cpp"):
            if name not in ok or ref is None:
                continue
            mean, worst = _diff(ok[name]["logprobs"], ref["logprobs"])
            target = ("met" if mean <= LP_TARGET_NATS else "NOT met") if name == "stagewise auto" else "—"
            rows.append([key, name, f"{mean:.4f}", f"{worst:.3f}", target])
        ppl = {n: _ppl(r["logprobs"]) for n, r in ok.items()}
        sw, lc = ppl.get("stagewise auto"), ppl.get("llama.cpp")
        rel = None if sw is None or lc is None else sw / lc - 1
        ppl_rows.append([key, *(f"{ppl[n]:.4g}" if n in ppl else "pending" for n in
                                ("reference", "stagewise auto", "stagewise float32", "llama.cpp")),
                         "pending" if rel is None else f"{rel:+.2%}",
                         "pending" if rel is None else ("met" if abs(rel) <= PPL_TARGET else "NOT met")])
        greedy += [f"- {n} on {key}: \"{PROMPT}\" → `{r['greedy_text']!r}`"
                   for n, r in ok.items() if "greedy_text" in r]
    return ["", f"Text: {numerics['text']}, {numerics['tokens']} tokens (SmolLM2's tokenizer); every token after "
            f"the first scored in one pass, {max(meta['threads'])} threads. Reference: the same file dequantized to "
            "fp32 by transformers' GGUF loader (gguf-py's dequantizers), run by transformers in fp32. stagewise "
            "through `LLM.generate(prompt_token_ids=..., SamplingParams(max_tokens=0, prompt_logprobs=0))`; "
            "llama.cpp through llama-cpp-python with `logits_all=True`. The 1B-class model has random weights "
            "(its perplexity is near the vocabulary size): only SmolLM2's numbers say anything about text.", "",
            "## Per-token log-probabilities against the fp32 reference (nats)", "",
            markdown_table(["file", "engine", "mean abs difference", "max abs difference",
                            f"target ≤ {LP_TARGET_NATS} (stagewise default)"], rows) if rows else "pending", "",
            "## Perplexity", "",
            markdown_table(["file", "reference fp32", "stagewise default", "stagewise float32", "llama.cpp",
                            "stagewise / llama.cpp − 1", f"target within {PPL_TARGET:.0%}"], ppl_rows), "",
            *(["## Greedy answer of the default model", "", *greedy, ""] if greedy else []),
            *failed]
