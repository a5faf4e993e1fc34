"""CPU speed levers side by side on the real model (SmolLM2-135M-Instruct), one run.

Every configuration runs in its own process per round (rounds alternate the order), on the same
seeded token-id prompts, greedy, ignore_eos: startup, TTFT on never-seen 200/512-token prompts,
decode ms/token at batch 1 and ms/step at batch 32, offline throughput (32 requests, prompts
32-256, 64 output tokens), and the same process's torch.mm rate for the prefill-512 FLOP ratio.
"before" configurations import stagewise from `git archive <rev> src` (the code before the CPU
work); the rest import the working tree. The parent measures memory read bandwidth (roofline)
and, for the dtype `auto` rule, fp32 vs bf16 on narrower models.

    python -m benchmarks.kernels cpu-speed [--quick] [--rounds 2] [--before-rev REV]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.common import (
    REPO,
    RESULTS_DIR,
    build_llama_checkpoint,
    cpu_line,
    export_src,
    markdown_table,
    random_workload,
    read_gbps,
    write_result,
)
from benchmarks.kernels.threads import busy_core

PEERS_HF = Path("~/.cache/stagewise/peers/smollm2-135m-instruct/hf").expanduser()
VOCAB = 49152
CONFIGS = {   # name -> (code, engine options, patch); dtype auto everywhere (bf16 only on CPUs with native bf16)
    "before": ("before", dict(), None),
    "eager (--prefill-graph off)": ("now", dict(prefill_graph="off"), None),
    "eager, KV gathered for SDPA": ("now", dict(prefill_graph="off"), "no_kernel"),
    "compiled (auto), cold cache": ("now", dict(), "cold_cache"),
    "compiled (auto)": ("now", dict(), None),
    "compiled, KV gathered for SDPA": ("now", dict(), "no_kernel"),
    "compiled, one core kept busy": ("now", dict(), "busy_core"),
    "eager, one core kept busy": ("now", dict(prefill_graph="off"), "busy_core"),
}


# ---- one configuration, in its own process -------------------------------------------------------

def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def mm_gflops(dtype: torch.dtype, reps: int = 5) -> float:
    a, b = torch.randn(512, 576).to(dtype), torch.randn(576, 1536).to(dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 512 * 576 * 1536 / statistics.median(times) / 1e9


def decode_read_bytes(model) -> int:
    """Weight bytes one batch-1 decode step streams: every matrix once (the tied head is the embedding)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)


def run_config(spec: dict) -> dict:
    from stagewise import LLM, SamplingParams
    q, out = spec["quick"], {"load": os.getloadavg()[0]}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], device="cpu", kv_cache_memory="1GiB", max_model_len=2048,
              compile_in_background=False, **spec["options"])
    out["startup_s"] = time.perf_counter() - t0
    out["dtype"] = str(llm.engine.executor.worker.model.dtype).replace("torch.", "")
    out["threads"] = torch.get_num_threads()
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)   # noqa: E731
    gen = lambda prompts, n: llm.generate(prompt_token_ids=prompts, sampling_params=greedy(n), use_tqdm=False)  # noqa: E731
    fresh = iter(random_workload(400, (32, 32), (1, 1), VOCAB, seed=7)[0])
    gen([next(fresh) for _ in range(4)], 4)                                         # warm-up

    def timed(prompts, n):
        t, c = time.perf_counter(), cpu_s()
        gen(prompts, n)
        return time.perf_counter() - t, cpu_s() - c
    for n, reps in ((200, 3 if q else 5), (512, 2 if q else 3)):
        prompts = random_workload(reps, (n, n), (1, 1), VOCAB, seed=n)[0]
        out[f"ttft{n}_ms"] = 1e3 * statistics.median(timed([p], 1)[0] for p in prompts)
    out["mm_gflops"] = mm_gflops(llm.engine.executor.worker.model.dtype)
    for batch, steps, key in ((1, 16 if q else 32, "decode1"), (32, 8 if q else 16, "decode32")):
        walls, cpus = [], []
        for _ in range(2 if q else 3):
            one = timed([next(fresh) for _ in range(batch)], 1)
            many = timed([next(fresh) for _ in range(batch)], 1 + steps)
            walls.append((many[0] - one[0]) / steps)
            cpus.append((many[1] - one[1]) / steps)
        out[f"{key}_ms"], out[f"{key}_cpu_ms"] = 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)
    prompts, _ = random_workload(32, (32, 256), (64, 64), VOCAB, seed=1)
    n_out = 16 if q else 64
    wall, _ = timed(prompts[:16] if q else prompts, n_out)
    out["offline_tok_s"] = (16 if q else 32) * n_out / wall
    out["read_bytes"] = decode_read_bytes(llm.engine.executor.worker.model)
    llm.shutdown()
    return out


# ---- the parent: rounds, machine facts, report ---------------------------------------------------

def spawn(name: str, src: Path, model: str, options: dict, patch, quick: bool) -> dict:
    spec = dict(model=model, options=options, patch=patch, quick=quick)
    env = dict(os.environ, PYTHONPATH=str(src))
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(var, None)                           # stagewise's own choice, as a user runs it
    if patch == "no_kernel":                         # the in-place decode attention kernel off
        env["STAGEWISE_CPU_KERNELS"] = "0"
    with tempfile.TemporaryDirectory(prefix="stagewise-inductor-") as cold:
        if patch == "cold_cache":                    # nothing compiled yet: the first start's cost
            env["TORCHINDUCTOR_CACHE_DIR"] = cold
        cmd = [sys.executable, "-m", "benchmarks.kernels", "cpu-speed", "--worker", json.dumps(spec)]
        with busy_core() if patch == "busy_core" else nullcontext():
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"configuration {name!r} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gemv_rows(model_dir: str) -> list[list]:
    """One-row GEMMs over every matrix of the model (weights far larger than the cache, as in batch-1
    decode): torch's native bf16 GEMV, oneDNN bf16, weight-only int8 (`aten._weight_int8pack_mm`,
    per-row scales) and fp32, at 1 and 2 threads. Median ms per pass over all matrices."""
    import torch.nn.functional as F

    from stagewise.checkpoint.facts import read_facts
    c = read_facts(model_dir).hf
    d = c.hidden_size // c.num_attention_heads
    shapes = [((c.num_attention_heads + 2 * c.num_key_value_heads) * d, c.hidden_size),
              (c.hidden_size, c.num_attention_heads * d), (2 * c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size)] * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)]
    w32 = [torch.randn(n, k) * 0.05 for n, k in shapes]
    wbf = [w.bfloat16() for w in w32]
    scales = [w.abs().amax(1) / 127 for w in w32]
    w8 = [((w / s[:, None]).round().to(torch.int8), s.bfloat16()) for w, s in zip(w32, scales)]
    xs = {k: torch.randn(1, k) for k in {k for _, k in shapes}}
    xb = {k: x.bfloat16() for k, x in xs.items()}
    kernels = {"native bf16": lambda: [F.linear(xb[w.shape[1]], w) for w in wbf],
               "oneDNN bf16": lambda: [F.linear(xb[w.shape[1]], w) for w in wbf],
               "int8 (weight-only)": lambda: [torch.ops.aten._weight_int8pack_mm(xb[q.shape[1]], q, s) for q, s in w8],
               "fp32": lambda: [F.linear(xs[w.shape[1]], w) for w in w32]}
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        row = [threads]
        for name, fn in kernels.items():
            torch.backends.mkldnn.enabled = name != "native bf16"
            fn()
            row.append(f"{1e3 * statistics.median(timed_s(fn) for _ in range(7)):.1f}")
        torch.backends.mkldnn.enabled = True
        rows.append(row)
    return rows


def timed_s(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def auto_rule_rows(tmp: Path, quick: bool, src: Path) -> list[list]:
    """fp32 vs bf16 on narrower Llamas (8 layers, the real model's vocabulary): where bf16 starts to pay."""
    rows = []
    for hidden in (128, 256, 512):
        path = build_llama_checkpoint(tmp / f"h{hidden}", vocab_size=VOCAB, hidden_size=hidden,
                                      intermediate_size=hidden * 8 // 3, num_hidden_layers=8,
                                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192),
                                      max_position_embeddings=2048)
        res = {d: spawn(f"h{hidden} {d}", src, str(path), dict(dtype=d), None, quick) for d in ("float32", "bfloat16")}
        f, b = res["float32"], res["bfloat16"]
        rows.append([hidden, *(f"{f[k]:.1f} / {b[k]:.1f} ({f[k] / b[k]:.2f}x)" for k in ("decode1_ms", "decode32_ms",
                                                                                            "ttft200_ms")),
                     f"{b['offline_tok_s'] / f['offline_tok_s']:.2f}x"])
    return rows


def prefill_flops(model_dir: str, tokens: int = 512) -> float:
    from stagewise.checkpoint.facts import read_facts
    c = read_facts(model_dir).hf
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    per_layer = c.hidden_size * (hq + 2 * hkv) * d + hq * d * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * hq * d * tokens * tokens            # q.k and p.v, causal half of 2 * 2 * T^2
    return c.num_hidden_layers * (2 * per_layer * tokens + attention) + 2 * c.hidden_size * c.vocab_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one round, small workloads")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before-rev", default="a125bb5", help="git revision of the 'before' code (eager, KV gathered)")
    ap.add_argument("--model", default=None, help="default: the peers benchmark's fp32 HF export, else the GGUF")
    ap.add_argument("--only", help="';'-separated configuration names to run (the 'before' one always runs)")
    ap.add_argument("--no-auto-rule", action="store_true", help="skip the narrower-model fp32/bf16 check")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_config(json.loads(args.worker))))
        return 0
    if args.model is None:
        from stagewise.model.source import resolve_model
        args.model = str(PEERS_HF) if (PEERS_HF / "config.json").exists() else resolve_model(None)
    configs = {n: c for n, c in CONFIGS.items() if not args.only or n in args.only.split(";") or n == BEFORE}
    rounds = 1 if args.quick else args.rounds
    started, load0 = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="stagewise-cpu-speed-") as tmp:
        srcs = {"before": export_src(args.before_rev, Path(tmp)), "now": REPO / "src"}
        results: dict[str, list[dict]] = {name: [] for name in configs}
        machine = []
        for r in range(rounds):
            machine.append({"read_gbs_2t": read_gbps(2), "read_gbs_1t": read_gbps(1), "load": os.getloadavg()[0],
                            "gemv": gemv_rows(args.model)})
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in names:
                code, options, patch = configs[name]
                res = spawn(name, srcs[code], args.model, options, patch, args.quick)
                results[name].append(res)
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}
                print(f"round {r + 1} {name}: {json.dumps(shown)}", flush=True)
        raw = dict(results=results, machine=machine, model=args.model, auto_rows=[])
        saved = RESULTS_DIR / f"cpu_speed{'-quick' if args.quick else ''}.json"
        saved.write_text(json.dumps(raw, indent=1))          # kept even if the auto-rule part fails
        raw["auto_rows"] = [] if args.no_auto_rule or args.quick else auto_rule_rows(Path(tmp), args.quick,
                                                                                    srcs["now"])
    saved.write_text(json.dumps(raw, indent=1))
    text = report(raw, args, started, load0)
    print(text)
    print(f"\nwritten to {write_result('cpu_speed', text, args.quick)}")
    plot(raw, args.quick)
    return 0


# ---- report ----------------------------------------------------------------------------------------

BEFORE = "before"
COLUMNS = (("offline_tok_s", "offline tok/s", max), ("ttft200_ms", "TTFT 200 ms", min),
           ("ttft512_ms", "TTFT 512 ms", min), ("decode1_ms", "decode b1 ms/token", min),
           ("decode1_cpu_ms", "decode b1 CPU ms/token", min), ("decode32_ms", "decode b32 ms/step", min))


def best(runs: list[dict], key: str, pick=min) -> float:
    return pick(r[key] for r in runs)


def ratio_vs(results: dict, name: str, key: str, higher_better: bool) -> str:
    """Median over rounds of the same-round speed-up against BEFORE (>1 = faster)."""
    pairs = zip(results[name], results[BEFORE])
    vals = [(a[key] / b[key]) if higher_better else (b[key] / a[key]) for a, b in pairs]
    return f"{statistics.median(vals):.2f}x"


def report(raw: dict, args, started: float, load0: float) -> str:
    res, machine, flops = raw["results"], raw["machine"], prefill_flops(raw["model"])
    bw = max(m["read_gbs_2t"] for m in machine)
    rows, ratio_rows, roof_rows = [], [], []
    for name, runs in res.items():
        r0 = runs[0]
        achieved = [flops / (r["ttft512_ms"] / 1e3) / 1e9 for r in runs]
        frac = max(a / r["mm_gflops"] for a, r in zip(achieved, runs))
        rows.append([name, r0["dtype"], r0["threads"], f"{best(runs, 'startup_s'):.1f}",
                     *(f"{best(runs, k, pick):.1f}" for k, _, pick in COLUMNS),
                     f"{max(achieved):.0f} / {best(runs, 'mm_gflops', max):.0f} ({frac:.0%})"])
        ratio_rows.append([name] + [ratio_vs(res, name, k, pick is max) for k, _, pick in COLUMNS if "cpu" not in k])
        limit = r0["read_bytes"] / (bw * 1e9) * 1e3
        roof_rows.append([name, f"{r0['read_bytes'] / 1e6:.0f}", f"{limit:.1f}", f"{best(runs, 'decode1_ms'):.1f}",
                          f"{best(runs, 'decode1_ms') / limit:.2f}x"])
    heads = ["configuration", "dtype", "threads", "startup s", *(h for _, h, _ in COLUMNS),
             "prefill 512 GFLOP/s / torch.mm (share)"]
    lines = [
        "# CPU speed levers on SmolLM2-135M-Instruct", "",
        f"Model `{raw['model']}` (30 layers, hidden 576, vocab 49152, tied head; the dequantized Q4_1 weights). "
        f"{os.cpu_count()} shared CPUs ({cpu_line()}); torch {torch.__version__}; stagewise's own thread and "
        f"OpenMP wait choice. 'before' = `git archive {args.before_rev} src` (eager, the KV gathered for SDPA); "
        "the rest = the working tree. "
        f"{len(machine)} round(s), each configuration in its own process, order reversed every other round; best "
        f"of the rounds per figure. 1-minute load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
        f"end (other engineers' jobs share these CPUs: read the same-round ratios). Run took "
        f"{(time.time() - started) / 60:.0f} min.", "",
        "Offline: 32 requests, prompts 32-256 tokens, 64 output tokens each. TTFT: one never-seen prompt, "
        "max_tokens=1 (median). Decode: (time for 1+n tokens - time for 1) / n on fresh 32-token prompts "
        "(median of 3); CPU ms = the process's CPU seconds over the same span (robust to being descheduled, "
        "not to memory contention). Prefill 512 GFLOP/s: "
        f"{flops / 1e9:.0f} GFLOP (linears, causal attention, one LM-head row) / TTFT 512, against torch.mm "
        "(512x576 @ 576x1536) in the configuration's dtype and threads, in the same process.", "",
        markdown_table(heads, rows), "",
        f"## Speed-up against '{BEFORE}' (same round, median over rounds; > 1 = faster)", "",
        markdown_table(["configuration"] + [h for k, h, _ in COLUMNS if "cpu" not in k], ratio_rows), "",
        "## Batch-1 decode against the weight-read limit", "",
        f"Memory read bandwidth (sum of 1 GiB fp32), best of rounds: {bw:.1f} GB/s with 2 threads, "
        f"{max(m['read_gbs_1t'] for m in machine):.1f} GB/s with 1. Limit = weight bytes one step streams / that.", "",
        markdown_table(["configuration", "weight MB read per step", "limit ms/token", "decode b1 ms/token",
                        "measured / limit"], roof_rows), "",
        "## One-row GEMM kernels over all of the model's matrices (ms per pass, same run)", "",
        "Why batch-1 steps use torch's native bf16 GEMV, and why weight-only int8 was left out: at one row it "
        "streams half of bf16's bytes but its kernel is no faster than the native bf16 GEMV here.", "",
        markdown_table(["round", "threads", "native bf16", "oneDNN bf16", "int8 (weight-only)", "fp32"],
                       [[i + 1, *row] for i, m in enumerate(machine) for row in m.get("gemv", [])]),
        "", "The same model against vLLM-CPU and llama.cpp: `peers.md`.",
    ]
    if raw["auto_rows"]:
        lines += ["", "## dtype auto: fp32 / bf16 on narrower models (8 layers, vocab 49152)", "",
                  markdown_table(["hidden", "decode b1 ms fp32 / bf16", "decode b32 ms", "TTFT 200 ms",
                                  "offline tok/s bf16 / fp32"], raw["auto_rows"])]
    lines += ["", "## Per round", "", markdown_table(
        ["round", "load", "read GB/s (2 threads)"] + [f"{n}: decode b1 / offline" for n in res],
        [[i + 1, f"{m['load']:.1f}", f"{m['read_gbs_2t']:.1f}"] + [
            f"{res[n][i]['decode1_ms']:.1f} / {res[n][i]['offline_tok_s']:.0f}" for n in res]
         for i, m in enumerate(machine)])]
    if args.quick:
        lines += ["", "_--quick smoke run: one round, small workloads; numbers not representative._"]
    return "\n".join(lines)


def plot(raw: dict, quick: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = raw["results"]
    names = list(res)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title, pick) in zip(axes, (COLUMNS[0], COLUMNS[1], COLUMNS[3])):
        vals = [best(res[n], key, pick) for n in names]
        ax.barh(names, vals, color=["#999" if n.startswith("before") else "#3a7" for n in names])
        ax.set_title(title)
        ax.invert_yaxis()
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("stagewise CPU levers, SmolLM2-135M (best of rounds)")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"cpu_speed{'-quick' if quick else ''}.png", dpi=110)
