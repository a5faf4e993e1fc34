"""N-gram (prompt lookup) speculative decoding on the default model, greedy: tok/s with and without
speculation at batch 1 and batch 8 on a copy-heavy workload (repeat / fix the typos in / convert to
JSON / rename in the given text) and a fresh-generation one (open questions), the acceptance, and
llama.cpp's prompt-lookup decoding (llama-cpp-python's `LlamaPromptLookupDecoding`) at batch 1 on
the same token ids. Configurations are interleaved round by round in one run (the machine is
shared); greedy outputs with and without speculation are compared token for token.

    python -m benchmarks.offline speculative [--rounds 2] [--prompts 8] [--max-tokens 160] [--quick] [--spec JSON]
                                     [--llamacpp-python PATH] [--prefill-graph off,compiled]
                                     [--compile-in-background]

The engines are built with the given `--prefill-graph` (default: the engine's default, auto; a
comma-separated list adds a pair of engines per choice, interleaved with the others, compared
against the first choice's non-speculative engine) and, unless `--compile-in-background`, with their
graphs compiled before the first request; with it the warm-up request does not wait for the
compile, so the rounds meet whatever the compile has finished.

tok/s is output tokens / wall seconds of the whole request (prefill included); "decode tok/s"
leaves out the time to the first token. llama.cpp gets the same weights (the F32 GGUF that
benchmarks/peers/model.py prepares from the default model) and the same thread count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import cpu_line, load_line, machine_line, markdown_table, met, peer_python, write_result

WORKER = Path(__file__).resolve().parents[1] / "workers" / "llamacpp_lookup.py"   # under llama.cpp's Python
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
LLAMACPP_VARIANTS = ("off", "lookup2")   # num_pred_tokens 2: its README's advice for CPU (10, the default, was slower)

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank. Every morning, the old farmer walks his "
    "three goats to the meadow, where they graze until noon. In the afternoon he repairs fences, feeds the "
    "chickens and reads the newspaper on the porch while drinking sweet tea.",
    "Our store opens at nine in the morning and closes at six in the evening from Monday to Friday. On "
    "Saturdays we open at ten and close at four. We are closed on Sundays and public holidays. Orders placed "
    "online before noon are shipped the same day.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, "
    "which contain the green pigment chlorophyll.",
    "To reset your password, open the settings page, choose the account tab and press the button labelled "
    "forgot password. You will receive an email with a link that stays valid for one hour. Follow the link "
    "and type your new password twice.",
]
TYPOS = [t.replace("the ", "teh ", 2).replace("and ", "adn ", 1).replace("ing ", "img ", 1) for t in TEXTS]
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += "
        "item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n")
COPY_TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{TEXTS[0]}",
    f"Fix the typos in the following text and write it out in full:\n\n{TYPOS[1]}",
    f"Repeat the following text exactly, word for word:\n\n{TEXTS[2]}",
    f"Fix the typos in the following text and write it out in full:\n\n{TYPOS[3]}",
    f"Repeat this paragraph word for word:\n\n{TEXTS[1]}",
    f"Rewrite this Python function with the variable `subtotal` renamed to `net`; output only the code.\n\n{CODE}",
    f"Copy the following text exactly:\n\n{TEXTS[3]}",
    "Convert this list to JSON with keys name, age and city:\nAlice, 31, Paris\nBob, 45, Berlin\nCarol, 27, "
    "Madrid\nDavid, 52, Rome\nEve, 38, Vienna",
]
FRESH_TASKS = [
    "Write a short poem about the ocean at night.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a birthday party for a child.",
    "What are the benefits of learning a second language?",
    "Describe a day in the life of a medieval blacksmith.",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a weekend hiking trip?",
    "Explain how a bicycle stays upright when it moves.",
]


class LlamaCpp:
    """A long-lived llama.cpp process (all variants loaded once) answering one generation per line."""

    def __init__(self, python: str, gguf: str, threads: int, ctx: int):
        cmd = [python, str(WORKER), gguf, str(threads), str(ctx), ",".join(LLAMACPP_VARIANTS)]
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited (see its stderr above)")
        return json.loads(line)

    def generate(self, variant: str, prompt: list[int], n: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"variant": variant, "prompt": prompt, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_ours(llm, prompts: list[list[int]], n: int, batch: int) -> dict:
    """Batches of `batch` prompts in order; output tokens, wall, and wall after each first token."""
    from stagewise import SamplingParams
    params = SamplingParams(max_tokens=n, temperature=0)
    tokens, wall, decode_wall, outs = 0, 0.0, 0.0, []
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        got = llm.generate(prompt_token_ids=prompts[i:i + batch], sampling_params=params, use_tqdm=False)
        now, dt = time.monotonic(), time.perf_counter() - t0
        wall += dt
        first = min(o.metrics.get("first_token_time", now) for o in got)
        decode_wall += now - first
        for o in got:
            outs.append(list(o.outputs[0].token_ids))
            tokens += len(o.outputs[0].token_ids)
    return {"tokens": tokens, "wall_s": wall, "decode_s": decode_wall, "decode_tokens": tokens - len(prompts),
            "outs": outs}


def run_llamacpp(peer: LlamaCpp, variant: str, prompts: list[list[int]], n: int) -> dict:
    tokens, wall, decode_wall, outs = 0, 0.0, 0.0, []
    for p in prompts:
        r = peer.generate(variant, p, n)
        tokens += len(r["tokens"])
        wall += r["wall_s"]
        decode_wall += r["wall_s"] - r["ttft_s"]
        outs.append(r["tokens"])
    return {"tokens": tokens, "wall_s": wall, "decode_s": decode_wall, "decode_tokens": tokens - len(prompts),
            "outs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--spec", default=json.dumps(DEFAULT_SPEC), help="speculative_config JSON")
    ap.add_argument("--threads", type=int, default=None, help="threads for both engines (default: stagewise's)")
    ap.add_argument("--llamacpp-python", default=peer_python("llamacpp"), help="'' to skip llama.cpp")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (at most 8)")
    ap.add_argument("--batches", default="1,8", help="batch sizes to run, e.g. 1")
    ap.add_argument("--name", default="speculative", help="results/NAME.md")
    ap.add_argument("--quick", action="store_true", help="2 prompts per workload, 1 round, 48 tokens")
    ap.add_argument("--prefill-graph", default=None,
                    help="the engines' prefill_graph, or a comma-separated list to compare (default: auto)")
    ap.add_argument("--compile-in-background", action="store_true",
                    help="the engines' default: compile while steps run eager (default here: compile first)")
    args = ap.parse_args()
    n, rounds = (48, 1) if args.quick else (args.max_tokens, args.rounds)
    batches = [int(b) for b in args.batches.split(",")]
    spec = json.loads(args.spec)

    from stagewise import LLM
    # NOTE: two engines in one process: a modest KV cache each (the default plans 2 GiB per engine)
    opts: dict = {"kv_cache_memory": "384MiB", "compile_in_background": args.compile_in_background}
    if args.threads is not None:
        opts["threads_per_stage"] = args.threads
    choices = args.prefill_graph.split(",") if args.prefill_graph else [None]
    engines: dict[str, object] = {}           # config name -> engine: "off", "ngram", then "off G", "ngram G"
    for i, g in enumerate(choices):
        graph_opts = {**opts, **({"prefill_graph": g} if g else {})}
        suffix = "" if i == 0 else f" {g}"
        engines["off" + suffix] = LLM(**graph_opts)
        engines["ngram" + suffix] = LLM(speculative_config=spec, **graph_opts)
    base = engines["off"]
    tok = base.tokenizer           # the model's HF tokenizer: chat template, then ids
    workloads = {name: [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                           add_generation_prompt=True)) for t in tasks]
                 for name, tasks in (("copy-heavy", COPY_TASKS), ("fresh", FRESH_TASKS))}
    workloads = {k: v[:2 if args.quick else args.prompts] for k, v in workloads.items()}
    import torch
    threads = args.threads or torch.get_num_threads()

    peer, notes = None, []
    if args.llamacpp_python and _has_llama_cpp(args.llamacpp_python):
        from benchmarks.peers.model import prepare
        gguf = str(prepare()["float32"])
        ctx = max(len(p) for ps in workloads.values() for p in ps) + n + 16
        peer = LlamaCpp(args.llamacpp_python, gguf, threads, ctx)
    else:
        notes.append(f"llama.cpp skipped: no Python with llama_cpp at `{args.llamacpp_python}`.")

    for llm in engines.values():                              # warm-up: compile, first-call costs
        run_ours(llm, workloads["fresh"][:1], 8, 1)
    if peer is not None:
        for v in LLAMACPP_VARIANTS:
            run_llamacpp(peer, v, workloads["fresh"][:1], 8)

    res: dict = defaultdict(list)        # (workload, config, batch) -> per-round dicts
    for r in range(rounds):
        for wname, prompts in workloads.items():
            for batch in batches:
                order = list(engines.items())
                for cname, llm in (order if r % 2 == 0 else order[::-1]):
                    before = llm.stats().get("speculative", {})
                    out = run_ours(llm, prompts, n, batch)
                    after = llm.stats().get("speculative", {})
                    out["spec"] = {k: after[k] - before.get(k, 0) for k in ("proposed", "accepted", "verify_steps")
                                   } if after else None
                    res[wname, cname, batch].append(out)
                    print(f"round {r} {wname} batch {batch} {cname}: {out['tokens'] / out['wall_s']:.1f} tok/s "
                          f"({load_line()})", flush=True)
            if peer is not None:
                for v in LLAMACPP_VARIANTS:
                    out = run_llamacpp(peer, v, prompts, n)
                    res[wname, f"llama.cpp {v}", 1].append(out)
                    print(f"round {r} {wname} batch 1 llama.cpp {v}: {out['tokens'] / out['wall_s']:.1f} tok/s",
                          flush=True)
    if peer is not None:
        peer.close()
    graphs = (f"prefill_graph {' vs '.join(g or 'auto (default)' for g in choices)}, "
              f"compiled {'in the background' if args.compile_in_background else 'before the first request'}")
    print(report(res, workloads, spec, n, rounds, threads, notes, args.quick, batches, args.name, graphs,
                 choices[1:]))


def _has_llama_cpp(python: str) -> bool:
    if not Path(python).exists():
        return False
    return subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def _row(wname: str, batch: int, cname: str, o: dict, base: dict) -> list:
    """One table row: throughputs, the ratio to `base` (the first plain engine), acceptance, mean accepted length."""
    s = o.get("spec")
    acc = f"{s['accepted'] / s['proposed']:.0%}" if s and s["proposed"] else "-"
    mean_len = f"{1 + s['accepted'] / s['verify_steps']:.2f}" if s and s["verify_steps"] else "-"
    return [wname, batch, cname, o["tokens"] / o["wall_s"], o["decode_tokens"] / o["decode_s"],
            (o["tokens"] / o["wall_s"]) / (base["tokens"] / base["wall_s"]), acc, mean_len]


def _best(runs: list[dict]) -> dict:
    """The fastest round (least disturbed by the other jobs on the machine)."""
    return max(runs, key=lambda o: o["tokens"] / o["wall_s"])


def report(res, workloads, spec, n, rounds, threads, notes, quick, batches, name="speculative",
           graphs: str = "prefill_graph auto (default), compiled before the first request",
           other_graphs: tuple | list = ()) -> str:
    rows, identical = [], {}
    targets = []
    for wname in workloads:
        for batch in batches:
            off, on = _best(res[wname, "off", batch]), _best(res[wname, "ngram", batch])
            # round by round: a later round's prompts hit the prefix cache (in both engines alike), and a
            # prompt prefilled over a cached prefix may differ in the last bits from one prefilled whole
            identical[wname, batch] = all(o["outs"] == p["outs"] for o, p in zip(res[wname, "off", batch],
                                                                                 res[wname, "ngram", batch]))
            shown = min(batch, len(workloads[wname]))
            rows += [_row(wname, shown, "stagewise", off, off), _row(wname, shown, "stagewise + ngram", on, off)]
            for g in other_graphs:
                g_off, g_on = _best(res[wname, f"off {g}", batch]), _best(res[wname, f"ngram {g}", batch])
                rows += [_row(wname, shown, f"stagewise, prefill_graph {g}", g_off, off),
                         _row(wname, shown, f"stagewise + ngram, prefill_graph {g}", g_on, off)]
                if batch == 1:
                    g_ratio = (g_on["tokens"] / g_on["wall_s"]) / (g_off["tokens"] / g_off["wall_s"])
                    targets.append(f"- {wname} batch 1, prefill_graph {g}: ngram {g_ratio:.2f}x of its "
                                   f"non-speculative engine, which runs "
                                   f"{(g_off['tokens'] / g_off['wall_s']) / (off['tokens'] / off['wall_s']):.2f}x "
                                   f"the first choice's")
            if batch == 1:
                for v in LLAMACPP_VARIANTS:
                    runs = res.get((wname, f"llama.cpp {v}", 1))
                    if runs:
                        o = _best(runs)
                        label = "llama.cpp" if v == "off" else f"llama.cpp prompt lookup k={v[6:]}"
                        rows.append([wname, 1, label,
                                     o["tokens"] / o["wall_s"], o["decode_tokens"] / o["decode_s"],
                                     (o["tokens"] / o["wall_s"]) / (off["tokens"] / off["wall_s"]), "-", "-"])
            ratio = (on["tokens"] / on["wall_s"]) / (off["tokens"] / off["wall_s"])
            if batch == 1:
                target = 2.0 if wname == "copy-heavy" else 0.97
                targets.append(f"- {wname} batch 1: {ratio:.2f}x of non-speculative (target >= {target}x): "
                               f"{met(ratio, target)}")
                llama = [_best(res[wname, f"llama.cpp {v}", 1]) for v in LLAMACPP_VARIANTS[1:]
                         if res.get((wname, f"llama.cpp {v}", 1))]
                if llama and wname == "copy-heavy":
                    best = max(o["tokens"] / o["wall_s"] for o in llama)
                    targets.append(f"- copy-heavy batch 1 vs llama.cpp's best prompt lookup: "
                                   f"{(on['tokens'] / on['wall_s']) / best:.2f}x (target > 1x): "
                                   f"{met((on['tokens'] / on['wall_s']) / best, 1.0 + 1e-9)}")
    same = all(identical.values())
    lines = [f"# Speculative decoding (n-gram prompt lookup){' (quick)' if quick else ''}", "",
             f"{cpu_line()}; {machine_line()}; {threads} threads; {load_line()} at the end.",
             f"Default model, greedy, up to {n} tokens (EOS ends a request), {len(workloads['fresh'])} prompts per "
             f"workload; best of {rounds} interleaved round(s). speculative_config: `{json.dumps(spec)}`; "
             f"{graphs}.", "",
             markdown_table(["workload", "batch", "engine", "tok/s", "decode tok/s", "x stagewise", "acceptance",
                             "tokens / verify step"], rows), "",
             f"Greedy outputs with and without speculation identical, round by round, in every batch: {same}", "",
             *targets, *(["", *notes] if notes else [])]
    text = "\n".join(lines)
    path = write_result(name, text, quick)
    return text + f"\n\n(written to {path})"
