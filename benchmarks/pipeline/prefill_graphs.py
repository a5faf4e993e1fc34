"""Prefill graphs: one stage's forward latency, graph vs eager, per bucket; capture time and
graph memory; and end-to-end time-to-first-token with PP=2, graphs vs eager, in one run.

On CPU the real graph backend is `compiled` (per-bucket torch.compile); `breakable`/`full`
are emulated there (no speed-up by design), so this script measures `compiled` by default.
On a CUDA machine pass `--backend breakable` (or `full`).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks import common  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from benchmarks.common import machine_line, markdown_table, median, met, temp_checkpoint, write_result
from stagewise import LLM, SamplingParams
from stagewise.graph.policy import GraphVerdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.kvcache.tensors import allocate_kv_caches
from stagewise.model.attention import AttentionMetadata, ForwardBatch
from stagewise.model.loader import load_model
from stagewise.parallel.partition import stage_infos
from stagewise.parallel.proxy import ProxyTensors


def stage_runner(model_dir, backend: str, buckets: list[int], device: str):
    """Stage 1 of 2 (a middle-of-pipeline body: proxy in, proxy or hidden out) behind a runner."""
    stage = stage_infos(8, 2)[1]
    model = load_model(model_dir, stage, torch.float32, device)
    heads, dim = model.kv_cache_spec()
    block, blocks = 16, max(buckets) // 16 + 4
    batch = ForwardBatch(None, allocate_kv_caches(stage, blocks, block, heads, dim, torch.float32, device))
    policy = resolve_graph_policy(backend, buckets=buckets, pp_size=2, device_type=device)
    runner = StageGraphRunner(model, stage, policy, batch, torch.float32, device, max_seq_len=max(buckets))
    mem0 = torch.cuda.memory_reserved() if device == "cuda" else 0
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    pool = runner.graph_pool_bytes() or ((torch.cuda.memory_reserved() - mem0) if device == "cuda" else 0)
    return runner, batch, model, capture_s, pool


def forward_latency(runner, batch, model, n: int, bucket: int | None, device: str, repeats: int) -> float:
    table = list(range(1, n // 16 + 2))
    meta = AttentionMetadata.build([n], [n], [table], 16, device)
    batch.meta = meta
    hidden = torch.randn(n, model.hidden_size, device=device)
    proxy = ProxyTensors({"hidden_states": hidden, "residual": torch.randn_like(hidden)})
    positions = torch.arange(n, device=device)
    verdict = GraphVerdict("prefill", bucket, None if bucket else "bench")
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.forward(verdict, None, positions, meta, proxy=proxy)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return median(times[2:])


def ttft(model_dir, options: dict, lengths: list[int], vocab: int) -> dict[int, float]:
    out = {}
    with LLM(model=str(model_dir), pp_size=2, dtype="float32", **options) as llm:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate(prompt_token_ids=[[7] * 16], sampling_params=params, use_tqdm=False)   # warm
        for i, n in enumerate(lengths):
            prompts = [[(13 * (j + 97 * i) + r) % (vocab - 6) + 6 for j in range(n)] for r in range(3)]
            times = []
            for p in prompts:          # distinct prompts: no prefix-cache hits
                t0 = time.perf_counter()
                llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            out[n] = median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two buckets, fewer repeats")
    ap.add_argument("--backend", default="compiled", choices=["compiled", "breakable", "full"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    buckets = [16, 64] if args.quick else [16, 64, 256, 1024]
    repeats = 3 if args.quick else 10
    torch.set_num_threads(2)
    size = dict(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                max_position_embeddings=2048)
    with temp_checkpoint(**size) as model_dir:
        runner, batch, model, capture_s, pool = stage_runner(model_dir, args.backend, buckets, args.device)
        rows = []
        for b in buckets:
            eager = forward_latency(runner, batch, model, b, None, args.device, repeats)
            graph = forward_latency(runner, batch, model, b, b, args.device, repeats)
            rows.append([b, eager * 1e3, graph * 1e3, graph / eager])
        e2e_buckets = buckets[:2]
        e2e_opts = dict(prefill_graph=args.backend, prefill_graph_buckets=",".join(map(str, e2e_buckets)))
        t_eager = ttft(model_dir, dict(prefill_graph="off"), e2e_buckets, size["vocab_size"])
        t_graph = ttft(model_dir, e2e_opts, e2e_buckets, size["vocab_size"])
    small = [r[3] for r in rows if r[0] <= 256]
    text = "\n".join([
        f"# Prefill graphs ({args.backend} on {args.device})", "", machine_line(),
        f"Model: Llama, {size['num_hidden_layers']} layers, hidden {size['hidden_size']}, vocab {size['vocab_size']}; "
        f"one stage = layers 4..8 (proxy in).", "",
        "## One stage's forward, one prefill of `bucket` tokens", "",
        markdown_table(["bucket", "eager ms", "graph ms", "graph / eager"], rows), "",
        f"Capture of {len(buckets)} buckets: {capture_s:.1f} s; graph pool: {pool / (1 << 20):.1f} MiB.",
        f"Target on a GPU: graph ≤ 0.5× eager at ≤ 256 tokens ({met(max(small), 0.5, False)} here, worst "
        f"{max(small):.2f}×), no worse at 1024.", "",
        "## End-to-end time to first token, PP=2 (two stage processes)", "",
        markdown_table(["prompt tokens", "eager ms", "graphs ms", "graphs / eager"],
                       [[n, t_eager[n] * 1e3, t_graph[n] * 1e3, t_graph[n] / t_eager[n]] for n in e2e_buckets]),
    ])
    print(text)
    print("written to", write_result(f"prefill_graph-{args.backend}-{args.device}", text, args.quick))
