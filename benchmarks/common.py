"""Shared helpers for the benchmark scripts: local tiny checkpoints (no hub), seeded workloads,
timing and percentiles, the machine lines every report opens with, writing results (markdown
table + optional PNG) to benchmarks/results/, and where downloads and made files are kept
(`cache_dir`, `peer_python`).

Benchmarks compare configurations side by side in one run and report ratios: absolute
timings on a shared CPU drift by ±15% between runs.
"""
from __future__ import annotations

import os
import subprocess

# NOTE: set before torch loads OpenMP. On a CPU shared with other jobs, OpenMP's default
# spin-waiting makes 2-thread ops up to ~10x slower than 1 thread; passive waiting keeps both
# systems (and the spawned pipeline stages, which inherit it) near their uncontended speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_llama_checkpoint(out_dir: str | Path, *, vocab_size: int = 32000, hidden_size: int = 256,
                           intermediate_size: int = 688, num_hidden_layers: int = 4, num_attention_heads: int = 4,
                           num_key_value_heads: int = 2, max_position_embeddings: int = 1024,
                           seed: int = 0) -> Path:
    """A seeded random-weight HF Llama checkpoint in fp32 with a (small) local tokenizer.

    Weights are redrawn at std 1/sqrt(fan_in) (norm scales 1 ± 0.1) so greedy argmaxes are well
    separated and HF and stagewise pick the same tokens despite different summation orders.
    """
    import transformers as tf

    from stagewise.model.demo import build_test_tokenizer
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                            num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                            bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * noise)
            else:
                scale = 1.0 if "embed" not in name else param.shape[-1] ** 0.5 * 0.1
                param.copy_(noise / param.shape[-1] ** 0.5 * scale)
    model.save_pretrained(out)
    tok_dir = out / ".tok"
    build_test_tokenizer(tok_dir, 1024, max_length=max_position_embeddings)
    for name in _TOKENIZER_FILES:
        shutil.copy(tok_dir / name, out / name)
    shutil.rmtree(tok_dir, ignore_errors=True)
    return out


@contextmanager
def temp_checkpoint(**kwargs):
    with tempfile.TemporaryDirectory(prefix="stagewise-bench-") as tmp:
        yield build_llama_checkpoint(Path(tmp) / "model", **kwargs)


def random_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                    vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts (token ids, never the special ids 0..5) and output lengths, both inclusive ranges."""
    gen = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt_len[0], prompt_len[1] + 1, (num_requests,), generator=gen).tolist()
    o_lens = torch.randint(output_len[0], output_len[1] + 1, (num_requests,), generator=gen).tolist()
    prompts = [torch.randint(6, vocab_size, (n,), generator=gen).tolist() for n in p_lens]
    return prompts, o_lens


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def median(values) -> float:
    return statistics.median(values)


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of `values`, nearest rank; NaN for none."""
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def cache_dir(*parts: str, create: bool = True) -> Path:
    """Where benchmarks keep what they download or make (model files, the peers' virtual
    environments): stagewise's own cache, $STAGEWISE_CACHE, else ~/.cache/stagewise."""
    root = Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise")
    path = root.joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def peer_python(name: str) -> str:
    """The interpreter of a peer's virtual environment (`vllm`, `llamacpp`, `convert`):
    $STAGEWISE_BENCH_<NAME>_PYTHON, else <cache_dir>/peers/<name>/bin/python (benchmarks/peers/bench.py
    says how to make them)."""
    return os.environ.get(f"STAGEWISE_BENCH_{name.upper()}_PYTHON") or str(
        cache_dir("peers", name, "bin", "python", create=False))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def met(ratio: float, target: float, higher_is_better: bool = True) -> str:
    ok = ratio >= target if higher_is_better else ratio <= target
    return "met" if ok else "NOT met"


def write_result(name: str, text: str, quick: bool = False) -> Path:
    """Write `text` to benchmarks/results/<name>.md (<name>-quick.md for smoke runs) and return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}{'-quick' if quick else ''}.md"
    path.write_text(text.rstrip() + "\n")
    return path


def export_src(rev: str, into: Path) -> Path:
    """`git archive REV src` extracted under `into`: stagewise as it was at REV, for before/after runs."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def load_line() -> str:
    """The 1-minute load average: how busy the shared machine was (2 CPUs; above 2 means contention)."""
    return f"load average {os.getloadavg()[0]:.1f}"


def machine_line() -> str:
    import platform

    import transformers
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs (shared), OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY') or 'unset'}")


def read_gbps(threads: int, reps: int = 5) -> float:
    """Memory read bandwidth in GB/s at `threads` torch threads (which stay set): a sum over 1 GiB of
    fp32, far beyond every cache (a STREAM-like read), best of `reps`."""
    torch.set_num_threads(threads)
    x = torch.ones(256 << 20)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def _spin(_=None) -> float:
    """A fixed single-thread compute task; returns its own wall seconds."""
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(400):
        a = torch.tanh(a @ a)
    return time.perf_counter() - t0


def _spin_worker(barrier, results) -> None:
    _spin()                                             # warm-up
    barrier.wait()
    results.put(_spin())


def _spin_in(n: int) -> float:
    """Run `n` spinning processes at once; the slowest one's seconds."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_spin_worker, args=(barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    times = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return max(times)


def parallel_capacity() -> float:
    """How many cores two single-thread processes actually get right now (2.0 on an idle 2-core
    machine, about 1.0 when other jobs keep it busy): 2 x (task alone) / (task beside a twin)."""
    return 2 * _spin_in(1) / _spin_in(2)


def cpu_line() -> str:
    """CPU model and its wide-vector flags: results differ between machines."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    pairs = [line.split(":", 1) for line in info.splitlines() if ":" in line]
    fields = {k.strip(): v.strip() for k, v in pairs}
    wide = sorted(f for f in fields.get("flags", "").split() if f.startswith(("avx512", "amx")) or f == "avx2")
    return f"{fields.get('model name', 'unknown CPU')}, flags: {' '.join(wide) or 'none of avx2/avx512/amx'}"
