"""Offline throughput and prefill latency: stagewise `LLM.generate` vs HF `model.generate`.

Same fp32 weights (a seeded tiny Llama with a 32k vocabulary, built locally), 2 intra-op
threads for both, greedy, lengths fixed by the request (ignore_eos / min_new_tokens).

1. Throughput: N requests (default 64), prompts 16–256 and outputs 16–128 tokens (seeded).
   HF generates one left-padded batch up to the longest output (and, for comparison, sorted
   batches of 16); only the requested output tokens count, for both.
2. Prefill latency: one request with max_tokens=1 through a warm engine (the whole
   `generate` call: an upper bound of time-to-first-token) vs one HF forward of the prompt.

    python -m benchmarks.offline throughput [--quick] [--num-requests 64] [--repeats 1]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    load_line,
    machine_line,
    markdown_table,
    median,
    met,
    random_workload,
    temp_checkpoint,
    timed,
    write_result,
)

THROUGHPUT_TARGET = 3.0      # stagewise output tok/s >= 3x HF
PREFILL_TARGET = 0.3         # stagewise TTFT <= 0.3x an HF forward at 16 tokens
VOCAB = 32000


def make_llm(model_dir, threads: int = 2):
    from stagewise import LLM
    return LLM(model=str(model_dir), dtype="float32", device="cpu", threads_per_stage=threads, max_num_seqs=64,
               kv_cache_memory="256MiB", max_model_len=1024, compile_in_background=False)


def run_stagewise(llm, prompts, out_lens) -> tuple[float, list[list[int]]]:
    from stagewise import SamplingParams
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    wall, outs = timed(llm.generate, prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return wall, [o.outputs[0].token_ids for o in outs]


def hf_generate(model, prompts, out_lens, batch_size: int | None) -> tuple[float, list[list[int]]]:
    """Left-padded batched greedy generation; a batch runs to its longest requested output."""
    order = list(range(len(prompts)))
    if batch_size:
        order.sort(key=lambda i: out_lens[i])
    batches = [order[i:i + (batch_size or len(order))] for i in range(0, len(order), batch_size or len(order))]
    tokens: list[list[int]] = [[] for _ in prompts]
    wall = 0.0
    for idx in batches:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), 2, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        n_new = max(out_lens[i] for i in idx)
        with torch.inference_mode():
            dt, out = timed(model.generate, input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                            min_new_tokens=n_new, do_sample=False, pad_token_id=2, eos_token_id=None)
        wall += dt
        for row, i in enumerate(idx):
            tokens[i] = out[row, width:width + out_lens[i]].tolist()
    return wall, tokens


def throughput(llm, hf, args) -> tuple[list[list], dict]:
    prompts, out_lens = random_workload(args.num_requests, (16, args.max_prompt), (16, args.max_output), VOCAB, seed=1)
    total_out = sum(out_lens)
    runs = {"stagewise": [], "hf_one_batch": [], "hf_sorted_bs16": []}
    toks = {}
    for _ in range(args.repeats):          # interleaved so drift hits every system alike
        wall, toks["stagewise"] = run_stagewise(llm, prompts, out_lens)
        runs["stagewise"].append(wall)
        wall, toks["hf_one_batch"] = hf_generate(hf, prompts, out_lens, None)
        runs["hf_one_batch"].append(wall)
        wall, toks["hf_sorted_bs16"] = hf_generate(hf, prompts, out_lens, 16)
        runs["hf_sorted_bs16"].append(wall)
    assert sum(len(t) for t in toks["stagewise"]) == total_out, "stagewise produced the wrong token count"
    same = sum(a == b for a, b in zip(toks["stagewise"], toks["hf_one_batch"]))
    best = {k: min(v) for k, v in runs.items()}
    tps = {k: total_out / v for k, v in best.items()}
    hf_best = max(tps["hf_one_batch"], tps["hf_sorted_bs16"])
    hf_generated = {"hf_one_batch": len(prompts) * max(out_lens),
                    "hf_sorted_bs16": sum(max(out_lens[i] for i in b) * len(b)
                                          for b in _sorted_batches(out_lens, 16))}
    rows = [["stagewise LLM.generate", f"{best['stagewise']:.2f}", total_out, total_out, f"{tps['stagewise']:.0f}",
             f"{tps['stagewise'] / hf_best:.2f}x"]]
    for key, label in (("hf_one_batch", f"HF generate, one batch of {len(prompts)}"),
                       ("hf_sorted_bs16",
                        f"HF generate, {-(-len(prompts) // 16)} batch(es) of ≤16 sorted by output length")):
        rows.append([label, f"{best[key]:.2f}", hf_generated[key], total_out, f"{tps[key]:.0f}",
                     f"{tps[key] / hf_best:.2f}x"])
    info = {"ratio": tps["stagewise"] / hf_best, "same": same, "n": len(prompts), "total_out": total_out,
            "prompt_tokens": sum(len(p) for p in prompts), "tps": tps}
    return rows, info


def _sorted_batches(out_lens, bs):
    order = sorted(range(len(out_lens)), key=lambda i: out_lens[i])
    return [order[i:i + bs] for i in range(0, len(order), bs)]


def prefill_latency(llm, hf, args) -> tuple[list[list], dict]:
    from stagewise import SamplingParams
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    rows, ratios = [], {}
    for n in args.prefill_lens:
        # fresh prompts each repeat: a repeated prompt would hit stagewise's prefix cache
        prompts, _ = random_workload(args.latency_repeats + 1, (n, n), (1, 1), VOCAB, seed=100 + n)
        sw, hf_full, hf_last = [], [], []
        for i, p in enumerate(prompts):
            t_sw, _ = timed(llm.generate, prompt_token_ids=[p], sampling_params=params, use_tqdm=False)
            ids = torch.tensor([p])
            with torch.inference_mode():
                t_full, _ = timed(hf, input_ids=ids)
                t_last, _ = timed(hf, input_ids=ids, logits_to_keep=1)
            if i:                                   # the first of each length is a warm-up
                sw.append(t_sw), hf_full.append(t_full), hf_last.append(t_last)
        s, f, last = median(sw) * 1e3, median(hf_full) * 1e3, median(hf_last) * 1e3
        ratios[n] = s / f
        rows.append([n, f"{s:.2f}", f"{f:.2f}", f"{last:.2f}", f"{s / f:.2f}x", f"{s / last:.2f}x"])
    return rows, ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 requests, short prompts and outputs")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="throughput runs per system (best is kept)")
    ap.add_argument("--latency-repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for both systems")
    args = ap.parse_args(argv)
    args.max_prompt, args.max_output, args.prefill_lens = 256, 128, (16, 128, 512)
    if args.quick:
        args.num_requests, args.max_prompt, args.max_output = 16, 64, 32
        args.latency_repeats, args.prefill_lens = 2, (16, 128)
    torch.set_num_threads(args.threads)
    args.load_before = load_line()
    from transformers import LlamaForCausalLM
    with temp_checkpoint(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024) as model_dir:
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        llm = make_llm(model_dir, args.threads)
        try:
            run_stagewise(llm, *random_workload(4, (16, 64), (4, 8), VOCAB, seed=99))   # warm-up
            hf_generate(hf, *random_workload(4, (16, 64), (4, 8), VOCAB, seed=99), None)
            t_rows, t_info = throughput(llm, hf, args)
            p_rows, p_ratios = prefill_latency(llm, hf, args)
        finally:
            llm.shutdown()
    args.load_after = load_line()
    text = report(args, t_rows, t_info, p_rows, p_ratios)
    print(text)
    name = "offline_throughput" + ("" if args.threads == 2 else f"-threads{args.threads}")
    print(f"\nwritten to {write_result(name, text, args.quick)}")
    return 0


def report(args, t_rows, t_info, p_rows, p_ratios) -> str:
    first = min(p_ratios)
    lines = [
        "# Offline throughput and prefill latency: stagewise vs HF transformers", "",
        f"Tiny Llama (vocab {VOCAB}, hidden 256, intermediate 688, 4 layers, 4 heads / 2 KV heads), "
        f"random seeded weights; {machine_line()}; {args.threads} intra-op thread(s) for both; "
        f"{args.load_before} at the start, {args.load_after} at the end.", "",
        f"## Throughput: {t_info['n']} requests, prompts 16–{args.max_prompt} tokens "
        f"({t_info['prompt_tokens']} in all), outputs 16–{args.max_output} ({t_info['total_out']} requested)", "",
        "Greedy, ignore_eos / min_new_tokens so every request yields exactly its requested length. HF must "
        "generate every batch up to its longest output; tok/s counts only the requested tokens for both. "
        f"Best of {args.repeats} interleaved run(s).", "",
        markdown_table(["system", "wall s", "tokens generated", "tokens counted", "output tok/s", "vs best HF"],
                       t_rows),
        "",
        f"**stagewise / best HF = {t_info['ratio']:.2f}x** (target ≥ {THROUGHPUT_TARGET:.0f}x: "
        f"{met(t_info['ratio'], THROUGHPUT_TARGET)}). Greedy outputs identical to HF for "
        f"{t_info['same']}/{t_info['n']} requests.", "",
        "## Prefill latency: one request, engine warm", "",
        "stagewise: wall time of `LLM.generate` with max_tokens=1 (schedule, forward, LM head on the last row, "
        "sample, detokenize) — an upper bound of time-to-first-token. HF: one `model(input_ids)` forward "
        "(logits for every position, the default), and with `logits_to_keep=1` for reference. "
        f"Median of {args.latency_repeats} fresh prompts per length (no prefix-cache hits).", "",
        markdown_table(["prompt tokens", "stagewise TTFT ms", "HF forward ms", "HF forward (last logits) ms",
                        "stagewise / HF", "stagewise / HF (last logits)"], p_rows),
        "",
        f"**TTFT at {first} tokens = {p_ratios[first]:.2f}x an HF forward** (target ≤ {PREFILL_TARGET}x: "
        f"{met(p_ratios[first], PREFILL_TARGET, higher_is_better=False)}).",
    ]
    if args.quick:
        lines += ["", "_--quick smoke run: small workload, numbers not representative._"]
    return "\n".join(lines)
