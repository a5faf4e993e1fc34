"""stagewise against llama.cpp on quantized GGUF files, side by side in one run: the 1B-class Llama
of models.py (Q4_K_M, Q4_0, Q8_0, BF16, ...) and the default model's own Q4_1 file.
Per file and thread count: batch-1 decode ms/token, TTFT of a fresh 512-token prompt, RSS after
load and peak RSS; stagewise's offline throughput (32 requests) on Q4_K_M against its own path on
the bf16 checkpoint of the same model. `--numerics`: per-token log-probabilities of ~2,000 tokens of
real text (the Python license shipped with the standard library) from stagewise's default and from
the file dequantized to fp32 (transformers' GGUF loader), and perplexity against llama.cpp's.

    python -m benchmarks.quantized make-models          # once: the files, under the cache dir (common.py)
    python -m benchmarks.quantized run [--quick] [--numerics] [--stagewise-src CHECKOUT/src]

Every engine run is its own process (engine order alternates per round; llama.cpp's short runs are
repeated); same seeded token-id prompts, greedy, ignore_eos; the best run is reported. stagewise is
used through `stagewise.LLM` only, imported from --stagewise-src (default: the installed package).
Writes results/quantized[-numerics].md and results/quantized.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import peer_process
from benchmarks.common import cache_dir, cpu_line, read_gbps
from benchmarks.peer_process import ProcTree, base_env, stagewise_env
from benchmarks.quantized import numerics as quantized_numerics
from benchmarks.quantized.models import DEFAULTS, model_paths
from benchmarks.quantized.section import cpu_record, versions_line

WORKER = Path(__file__).resolve().parents[1] / "workers" / "gguf_engine.py"
FIRST_ORDINARY_ID = 17                    # SmolLM2's ids 0..16 are special tokens
TARGET_FILES = ("Q4_K_M", "Q4_0", "Q8_0", "BF16", "smollm2")
CHECKPOINT = "checkpoint"                 # stagewise's own path: the 1B model's bf16 HF checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--models", default=DEFAULTS["out"], help="the model files' directory (make-models --out)")
    ap.add_argument("--files", default=",".join(TARGET_FILES),
                    help="files to run: 1B-class types (Q4_K_M, Q4_0, Q8_0, BF16, Q4_1, Q5_0, Q5_1, Q5_K_M, Q6_K) "
                         "and 'smollm2' (the default model's Q4_1 file), or paths of other .gguf files (make-shapes' "
                         "files: run by token ids, named by their stem)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--engines", default="llamacpp,stagewise", help="engines to run (llamacpp, stagewise)")
    ap.add_argument("--llamacpp-python", default=DEFAULTS["llamacpp_python"],
                    help="Python of the llama-cpp-python venv")
    ap.add_argument("--stagewise-src", default=None, metavar="DIR",
                    help="import stagewise from DIR (another checkout's src)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every run, best kept (default 2; quick 1)")
    ap.add_argument("--llamacpp-repeats", type=int, default=None,
                    help="llama.cpp runs per round, best kept (default 3; quick 1)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="decode steps timed (default 64; quick 16)")
    ap.add_argument("--ttft-prompts", type=int, default=None, help="timed 512-token prompts per run (default 2)")
    ap.add_argument("--offline-files", default="Q4_K_M", help="files for stagewise's offline throughput ('' to skip)")
    ap.add_argument("--own-dtypes", default="auto,bfloat16",
                    help="stagewise dtypes on the bf16 checkpoint (its own path, the throughput baseline)")
    ap.add_argument("--numerics", action="store_true", help="also the log-probability / perplexity comparison")
    ap.add_argument("--numerics-only", action="store_true", help="only the numerics comparison")
    ap.add_argument("--numerics-files", default="Q4_K_M,Q4_0,Q8_0,smollm2", help="files for --numerics")
    ap.add_argument("--numerics-tokens", type=int, default=2000)
    ap.add_argument("--llamacpp-no-extra-bufts", choices=("auto", "yes", "no"), default="auto",
                    help="turn off ggml's extra buffer types (auto: on AMX CPUs, where its Q4_1 kernel crashes)")
    ap.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE"), default=None,
                    help="force OpenMP's wait policy on both engines (default: each engine's own)")
    ap.add_argument("--engine-timeout", type=float, default=1800.0, help="seconds per engine run, then killed")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, small workloads")
    ap.add_argument("--note", action="append", default=[], help="a line for the report (e.g. other load)")
    ap.add_argument("--report-from", default=None, metavar="JSON", help="only re-render a saved run")
    ap.add_argument("--tag", default="", help="name the report files quantized-TAG.md (runs on other files)")
    args = ap.parse_args(argv)
    peer_process.OMP_WAIT_POLICY = args.omp_wait_policy
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    args.files, args.engines, args.own_dtypes = split(args.files), split(args.engines), split(args.own_dtypes)
    args.other_files = {Path(f).stem: Path(f) for f in args.files if f.endswith(".gguf")}
    args.files = [Path(f).stem if f.endswith(".gguf") else f for f in args.files]
    args.offline_files, args.numerics_files = split(args.offline_files), split(args.numerics_files)
    args.threads = [int(t) for t in split(args.threads)]
    args.numerics = args.numerics or args.numerics_only
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.llamacpp_repeats = args.llamacpp_repeats or (1 if args.quick else 3)
    if args.rounds < 1 or args.llamacpp_repeats < 1 or not args.threads or min(args.threads) < 1:
        ap.error("--rounds, --llamacpp-repeats and --threads must be at least 1.")
    if set(args.engines) - {"llamacpp", "stagewise"}:
        ap.error("--engines takes llamacpp and/or stagewise.")
    return args


def file_paths(args) -> dict[str, Path]:
    """Every requested file (plus the bf16 checkpoint), checked to exist before anything runs."""
    p = {**model_paths(args.models), **args.other_files}
    files = {key: p["smollm2_q4_1" if key == "smollm2" else key] for key in
             {*args.files, *args.offline_files, *(args.numerics_files if args.numerics else [])}}
    files[CHECKPOINT] = p["hf_1b"]
    missing = [str(v) for v in files.values() if not v.exists()]
    if missing:
        sys.exit(f"Missing model files: {', '.join(missing)}; run `python -m benchmarks.quantized make-models` first.")
    files["tokenizer"] = p["tokenizer"]
    return files


def sizes(args) -> dict:
    size = {"ttft_reps": 1, "decode_n": 16, "n_req": 8, "out": 16} if args.quick else \
        {"ttft_reps": 2, "decode_n": 64, "n_req": 32, "out": 64}
    size["ttft_reps"] = args.ttft_prompts or size["ttft_reps"]
    size["decode_n"] = args.decode_tokens or size["decode_n"]
    return size


def workload(vocab: int, size: dict) -> dict:
    """Seeded token-id prompts shared by every run; each timed prompt is used once per process."""
    rng = random.Random(0)
    prompts = lambda n, lo, hi: [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(lo, hi))]
                                 for _ in range(n)]
    return {"warmup": prompts(2, 16, 64), "ttft": prompts(1 + size["ttft_reps"], 512, 512),
            "decode": {"first": prompts(2, 32, 32), "long": prompts(2, 32, 32), "n": size["decode_n"]},
            "throughput": (prompts(size["n_req"], 32, 256), size["out"])}


def plan_runs(args, files: dict, work: dict) -> list[list[dict]]:
    """Groups of runs that alternate inside a round: one group per (file, threads)."""
    no_bufts = args.llamacpp_no_extra_bufts == "yes" or (args.llamacpp_no_extra_bufts == "auto" and "amx" in cpu_line())
    latency = {k: work[k] for k in ("warmup", "ttft", "decode")}
    # KV sized for one 2048-token context in fp32 (llama.cpp holds the same context), so RSS compares weights.
    common = dict(max_model_len=2048, kv_cache="256MiB")
    groups: list[list[dict]] = []
    for key in args.files:
        for threads in args.threads:
            group = []
            if "llamacpp" in args.engines:
                group.append(dict(engine="llamacpp", file=key, threads=threads, kind="latency", model=str(files[key]),
                                  no_extra_bufts=no_bufts, repeats=args.llamacpp_repeats, **common, **latency))
            if "stagewise" in args.engines:
                group.append(dict(engine="stagewise", file=key, threads=threads, kind="latency", dtype="auto",
                                  model=str(files[key]), **common, **latency))
            groups.append(group)
    if "stagewise" in args.engines:
        for threads in args.threads:            # its own path on the same model: the BF16 rows' reference
            groups.append([dict(engine="stagewise", file=CHECKPOINT, threads=threads, kind="latency", dtype=d,
                                model=str(files[CHECKPOINT]), **common, **latency) for d in args.own_dtypes])
        offline = dict(max_model_len=2048, kv_cache="1GiB", warmup=work["warmup"], throughput=work["throughput"])
        threads = max(args.threads)
        groups.append([dict(engine="stagewise", file=k, threads=threads, kind="offline", dtype="auto",
                            model=str(files[k]), **offline) for k in args.offline_files]
                      + [dict(engine="stagewise", file=CHECKPOINT, threads=threads, kind="offline", dtype=d,
                              model=str(files[CHECKPOINT]), **offline) for d in args.own_dtypes])
    return [g for g in groups if g]


def label(run: dict) -> str:
    dtype = f" {run['dtype']}" if run["engine"] == "stagewise" else ""
    return f"{run['engine']}{dtype} | {run['file']} | {run['threads']}t | {run['kind']}"


def run_worker(args, run: dict, tmp: Path, tag: str) -> dict:
    """The worker under the engine's own Python; its JSON plus the process tree's sampled peak RSS."""
    python = args.llamacpp_python if run["engine"] == "llamacpp" else sys.executable
    env = stagewise_env(args.stagewise_src) if run["engine"] == "stagewise" else base_env()
    spec_path, out_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.out.json"
    spec_path.write_text(json.dumps(run))
    out_path.unlink(missing_ok=True)            # never read another run's answer
    t0, load = time.monotonic(), os.getloadavg()
    tree = ProcTree([python, str(WORKER), str(spec_path), str(out_path)], env, tmp / f"{tag}.log", tmp)
    try:
        while tree.alive() and not out_path.exists() and time.monotonic() - t0 < args.engine_timeout:
            tree.sample()
            time.sleep(0.2)
        timed_out = tree.alive() and not out_path.exists()
    finally:
        tree.kill()
    if not out_path.exists():
        why = f"timed out after {args.engine_timeout:.0f} s" if timed_out else f"exited with {tree.proc.returncode}"
        return {"error": why, "log_tail": tree.tail(), "load_at_start": load}
    res = json.loads(out_path.read_text())
    res.update(run_wall_s=time.monotonic() - t0, load_at_start=load, peak_rss_mib=max(
        tree.peak_rss / 2**20, res["self_peak_rss_mib"]))
    return res


def run_rounds(args, groups: list[list[dict]], tmp: Path, saved: dict, save_path: Path) -> None:
    """Every run of every round into saved["results"], saved to `save_path` after each (a long run
    that is stopped can still be rendered with --report-from)."""
    from benchmarks.quantized import report as rep
    results = saved["results"]
    for rnd in range(args.rounds):
        for g, group in enumerate(groups):
            order = list(enumerate(group))
            for i, run in (order if (rnd + g) % 2 == 0 else order[::-1]):
                for rep_i in range(run.get("repeats", 1)):
                    tag = f"r{rnd}-g{g}-{i}-{run['engine']}-{run.get('dtype', '')}-{rep_i}"     # unique per run
                    print(f"[round {rnd + 1}/{args.rounds}] {label(run)} ...", flush=True)
                    res = run_worker(args, run, tmp, tag)
                    print(f"    {rep.one_line(res)}", flush=True)
                    results.setdefault(label(run), []).append(res)
                    save_path.write_text(json.dumps(saved))


def main(argv=None) -> int:
    from benchmarks.quantized import report as rep
    args = parse_args(argv)
    # NOTE: SIGTERM as SystemExit, so run_worker's `finally` kills the engine process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.report_from:
        rep.write_outputs(json.loads(Path(args.report_from).read_text()), args.tag)
        return 0
    files = file_paths(args)
    size, t_start = sizes(args), time.perf_counter()
    meta = {"quick": args.quick, "rounds": args.rounds, "llamacpp_repeats": args.llamacpp_repeats, "size": size,
            "cpu": cpu_record(), "machine": versions_line(args.omp_wait_policy), "load_before": os.getloadavg(),
            "stagewise": rep.stagewise_line(args.stagewise_src), "notes": args.note,
            "omp_wait_policy": args.omp_wait_policy, "threads": args.threads,
            "files": {k: rep.file_info(v) for k, v in files.items() if k not in ("tokenizer", CHECKPOINT)}}
    print(f"{meta['cpu']}\n{meta['machine']}\n{meta['stagewise']}", flush=True)
    meta["bandwidth_gbps"] = {str(t): read_gbps(t) for t in args.threads}
    saved: dict = {"meta": meta, "results": {}, "numerics": None}
    save_dir = cache_dir("quantized")
    parts = [f"-{args.tag}" if args.tag else "", "-quick" if args.quick else "",
             "-numerics" if args.numerics_only else ""]
    path = save_dir / f"last-run{''.join(parts)}.json"
    with tempfile.TemporaryDirectory(prefix="stagewise-quantized-") as tmp:
        if not args.numerics_only:
            vocab = json.loads((files[CHECKPOINT] / "config.json").read_text())["vocab_size"]
            run_rounds(args, plan_runs(args, files, workload(vocab, size)), Path(tmp), saved, path)
        if args.numerics:
            saved["numerics"] = quantized_numerics.run(args, files, Path(tmp), run_worker)
    meta.update(load_after=os.getloadavg(), wall_min=(time.perf_counter() - t_start) / 60)
    path.write_text(json.dumps(saved))
    rep.write_outputs(saved, args.tag)
    print(f"(measurements saved to {path}; --report-from it re-renders the report)")
    return 0
