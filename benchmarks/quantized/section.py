"""The part of benchmarks/quantized/bench.py's output that goes into benchmarks/RESULTS.md: the machine
(CPU model, family/model/stepping, which of the instruction sets the kernels choose between it has
and lacks), one side-by-side table per file and thread count, and every target of the quantized
work marked met or not. Written to results/quantized-section.md.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

from benchmarks.common import markdown_table

# The instruction sets a CPU kernel here picks between (run-time dispatch), listed as present or absent.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512vbmi", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
NAMES = {"smollm2": "SmolLM2-135M Q4_1 (its own file)"}
DECODE_FILES = {"Q4_K_M", "Q4_0", "Q8_0", "smollm2"}        # the decode targets; other types for reference
DECODE_TARGET, TTFT_TARGET, OFFLINE_TARGET = 1.0, 0.7, 1.2
RESIDENT_TARGET, LOAD_PEAK_TARGET = 1.15, 1.3


def cpu_record() -> str:
    """CPU model, family/model/stepping, logical CPUs, and which of ISA_FLAGS it has and lacks."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields: dict[str, str] = {}
    for line in info.splitlines():             # the first processor's block is enough
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    ident = " ".join(f"{k.split()[-1]} {fields.get(k, '?')}" for k in ("cpu family", "model", "stepping"))
    has = " ".join(f for f in ISA_FLAGS if f in flags) or "none"
    lacks = " ".join(f for f in ISA_FLAGS if f not in flags) or "none"
    return (f"{fields.get('model name', platform.processor() or 'unknown CPU')} ({ident}), {os.cpu_count()} logical "
            f"CPUs; has {has}; lacks {lacks}")


def versions_line(omp_wait_policy: str | None) -> str:
    import torch
    import transformers
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
            f"OpenMP wait policy: {omp_wait_policy or 'each engine its own default'}")


def _ratio(num: float | None, den: float | None, target: float | None, higher: bool = False) -> tuple[str, str]:
    if num is None or den is None:
        return "pending", "pending" if target else "—"
    if num <= 0 or den <= 0:             # a decode difference lost in noise (a loaded machine)
        return "invalid", "invalid" if target else "—"
    r = num / den
    if target is None:
        return f"{r:.2f}×", "—"
    return f"{r:.2f}×", "met" if (r >= target if higher else r <= target) else "**not met**"


def _v(x: float | None, digits: int = 1) -> str:
    return "pending" if x is None else f"{x:.{digits}f}"


def section(saved: dict, best, key) -> str:
    """`best` and `key` are quantized_report's reducers (runs -> best run; run label)."""
    meta, numerics = saved["meta"], saved.get("numerics")
    title = "## Quantized GGUF files against llama.cpp (`quantized.py`)" if saved["results"] else \
        "## Quantized GGUF files: numerics (`quantized.py --numerics-only`)"
    lines = [title, "", f"CPU: {meta['cpu']}. {meta['machine']}.",
             f"{meta['stagewise']}. llama.cpp: {_llamacpp_info(saved)}. Load average (1 min) "
             f"{meta['load_before'][0]:.2f} at the start, {(meta.get('load_after') or [float('nan')])[0]:.2f} at the "
             f"end; the whole run took {meta.get('wall_min', float('nan')):.0f} min."
             f"{' Quick smoke run: not representative.' if meta['quick'] else ''}", ""]
    if saved["results"]:
        lines += _speed(saved, best, key)
    if numerics:
        from benchmarks.quantized import numerics as quantized_numerics
        lines += [line.replace("## ", "### ", 1) if line.startswith("## ") else line
                  for line in quantized_numerics.section(numerics, meta)]
    return "\n".join(lines)


def _speed(saved: dict, best, key) -> list[str]:
    meta, res = saved["meta"], {k: best(v) for k, v in saved["results"].items()}
    get = lambda *a, **k: res.get(key(*a, **k)) or {}
    files = [f for f in meta["files"] if any(f" | {f} | " in k for k in res)]
    name = lambda f: NAMES.get(f, f"1B-class {f}")
    speed: list[list] = []
    mem: list[list] = []
    verdicts: dict[str, list[tuple[str, str]]] = {"decode": [], "ttft": [], "resident": [], "load": []}
    for f in files:
        info = meta["files"][f]
        for t in meta["threads"]:
            lc, sw = get("llamacpp", f, t), get("stagewise", f, t)
            dec = _ratio(sw.get("decode"), lc.get("decode"), DECODE_TARGET if f in DECODE_FILES else None)
            ttft = _ratio(sw.get("ttft"), lc.get("ttft"), TTFT_TARGET if f != "BF16" else None)
            speed.append([name(f), t, _v(lc.get("decode")), _v(sw.get("decode")), *dec,
                          _v(lc.get("ttft"), 0), _v(sw.get("ttft"), 0), *ttft])
            verdicts["decode"].append((f"{f} {t}t", dec[1]))
            verdicts["ttft"].append((f"{f} {t}t", ttft[1]))
        tensor_mib = info["tensor_bytes"] / 2**20
        sw_runs = [get("stagewise", f, t) for t in meta["threads"] if get("stagewise", f, t)]
        lc_runs = [get("llamacpp", f, t) for t in meta["threads"] if get("llamacpp", f, t)]
        most = lambda runs, k: max((r[k] for r in runs if r.get(k) is not None), default=None)
        resident, load_peak = most(sw_runs, "load_delta"), most(sw_runs, "load_peak_delta")
        res_r = _ratio(resident, tensor_mib, RESIDENT_TARGET if f != "BF16" else None)
        peak_r = _ratio(load_peak, tensor_mib, LOAD_PEAK_TARGET if f != "BF16" else None)
        mem.append([name(f), f"{tensor_mib:.0f}", _v(most(lc_runs, "peak_rss"), 0), _v(most(sw_runs, "peak_rss"), 0),
                    _v(resident, 0), res_r[0], _v(load_peak, 0), peak_r[0]])
        verdicts["resident"].append((f, res_r[1]))
        verdicts["load"].append((f, peak_r[1]))
    offline = {k: v for k, v in res.items() if k.endswith("| offline") and v}
    own = next((v["tps"] for d in ("auto", "bfloat16") for k, v in offline.items()
                if k.startswith(f"stagewise {d} | checkpoint |")), None)       # auto where it ran, else bf16
    off_rows = [[k.replace(" | offline", "").replace(" | ", ", "), f"{v['tps']:.1f}",
                 *(_ratio(v["tps"], own, OFFLINE_TARGET, True) if "| checkpoint |" not in k else ("—", "—"))]
                for k, v in offline.items()]
    return [
        "The same GGUF file in both engines (made by `make_quant_models.py`: a 1B-class Llama of Llama-3.2-1B's "
        "shape with random bf16 weights, converted and quantized by llama.cpp's own tools; and the default model's "
        f"own Q4_1 file); same token-id prompts, greedy; each engine in its own process; best of {meta['rounds']} "
        f"round(s) × {meta['llamacpp_repeats']} llama.cpp run(s). Full tables: `results/quantized.md`.", "",
        markdown_table(["file", "threads", "decode ms/token llama.cpp", "stagewise", "ratio", f"≤ {DECODE_TARGET}×",
                        "TTFT 512 ms llama.cpp", "stagewise", "ratio", f"≤ {TTFT_TARGET}×"], speed), "",
        "Memory (MiB). Peak: the whole process tree. Resident / load peak: stagewise's RSS after load and its "
        "high-water mark during load, less the same process's RSS before the engine was made (Python, torch and "
        "its compiler imported), against the file's tensor bytes (one stage holds them all): the weights as held "
        "plus the KV pages touched, static graph buffers and compiled code.", "",
        markdown_table(["file", "tensor MiB", "llama.cpp peak", "stagewise peak", "stagewise resident", "÷ tensors",
                        "stagewise load peak", "÷ tensors"], mem), "",
        f"Offline throughput, stagewise only ({meta['size']['n_req']} requests, {meta['size']['out']} output tokens "
        f"each, {max(meta['threads'])} threads), against its own path on the same model's bf16 checkpoint:", "",
        markdown_table(["run", "output tok/s", "÷ own checkpoint path", f"≥ {OFFLINE_TARGET}×"], off_rows)
        if off_rows else "pending", "",
        "Targets:", "",
        _verdict_line(f"batch-1 decode ≤ {DECODE_TARGET}× llama.cpp (Q4_K_M, Q4_0, Q8_0, SmolLM2 Q4_1)",
                      verdicts["decode"]),
        _verdict_line(f"TTFT of a fresh 512-token prompt ≤ {TTFT_TARGET}× llama.cpp", verdicts["ttft"]),
        _verdict_line(f"offline throughput on Q4_K_M ≥ {OFFLINE_TARGET}× the bf16 checkpoint path",
                      [(r[0], r[3]) for r in off_rows if r[3] != "—"]),
        _verdict_line(f"weights resident ≤ {RESIDENT_TARGET}× the tensor bytes (judged on what loading added, which "
                      "also holds the KV pages touched and graph buffers: an upper bound)", verdicts["resident"]),
        _verdict_line(f"peak RSS during load ≤ {LOAD_PEAK_TARGET}× the tensor bytes", verdicts["load"]),
        ""]


def _verdict_line(target: str, verdicts: list[tuple[str, str]]) -> str:
    judged = [(what, "not met (invalid)" if v == "invalid" else v) for what, v in verdicts if v not in ("—", "pending")]
    if not judged:
        return f"- {target}: pending"
    missed = [what for what, v in judged if v != "met"]
    status = "**met**" if not missed else f"**not met** ({', '.join(missed)})"
    return f"- {target}: {status}, {len(judged) - len(missed)} of {len(judged)} met"


def _llamacpp_info(saved: dict) -> str:
    runs = [r for rounds in saved["results"].values() for r in rounds]
    runs += [r for per_file in ((saved.get("numerics") or {}).get("files") or {}).values() for r in per_file.values()]
    for r in runs:
        if (r.get("info") or {}).get("system"):
            return f"llama-cpp-python {r['info']['version']} (`{r['info']['system']}`)"
    return "not run"
