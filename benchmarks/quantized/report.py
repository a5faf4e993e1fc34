"""Tables and the plot of benchmarks/quantized/bench.py: runs reduced to the best one (times: lowest;
memory: highest), stagewise / llama.cpp ratios against the issue's targets, the bandwidth floor of
each file (tensor bytes a decode step reads / measured read bandwidth), stagewise's offline
throughput against its own bf16-checkpoint path, and the numerics comparison.
"""
from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

from benchmarks.common import RESULTS_DIR, markdown_table
from benchmarks.quantized import section as quantized_section
from benchmarks.quantized.models import QUANT_TYPES

LABELS = {"smollm2": "SmolLM2-135M Q4_1 (its own file)", "checkpoint": "1B bf16 HF checkpoint"}
DECODE_TARGET = {"Q4_K_M", "Q4_0", "Q8_0", "smollm2"}          # decode <= 1.0x llama.cpp
PENDING = "pending"


def file_info(path: Path) -> dict:
    """Size, tensor bytes, bytes one decode step reads (every matrix; the embedding only as a tied LM
    head) and tensor types of a GGUF file."""
    import gguf
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    gathered = sum(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight" and "output.weight" in names)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"path": str(path), "file_bytes": path.stat().st_size, "tensor_bytes": tensor_bytes,
            "decode_bytes": tensor_bytes - gathered, "types": types}


def stagewise_line(src: str | None) -> str:
    from importlib.util import find_spec
    spec = None if src else find_spec("stagewise")
    where = Path(src).resolve() if src else Path(spec.origin).parent if spec and spec.origin else Path.cwd()
    head = subprocess.run(["git", "-C", str(where), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True).stdout.strip()[:100]
    return f"stagewise imported from `{where}` (commit there: {head or 'unknown'})"


def one_line(res: dict) -> str:
    if "error" in res:
        return f"FAILED: {res['error']}\n{res.get('log_tail', '')[-800:]}"
    parts = [f"load {res['load_s']:.1f} s", f"RSS after load {res['rss_after_load_mib']:.0f} MiB",
             f"peak {res['peak_rss_mib']:.0f} MiB"]
    if "ttft_ms" in res:
        parts.append(f"TTFT512 {statistics.median(res['ttft_ms']):.0f} ms")
    if "decode_ms" in res:
        parts.append(f"decode {res['decode_ms']:.1f} ms/token")
    if "throughput" in res:
        parts.append(f"{_tps(res):.1f} output tok/s")
    return ", ".join(parts)


def _tps(res: dict) -> float:
    return res["throughput"]["output_tokens"] / res["throughput"]["wall_s"]


def best(rounds: list[dict]) -> dict | None:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return None
    s = {"n_ok": len(ok), "n": len(rounds), "rss_after_load": max(r["rss_after_load_mib"] for r in ok),
         "peak_rss": max(r["peak_rss_mib"] for r in ok), "load_s": min(r["load_s"] for r in ok),
         "info": ok[0].get("info")}
    if all("rss_before_load_mib" in r for r in ok):   # what loading added to the process: weights, KV, buffers
        s["load_delta"] = max(r["rss_after_load_mib"] - r["rss_before_load_mib"] for r in ok)
        s["load_peak_delta"] = max(max(r["peak_after_load_mib"], r["rss_after_load_mib"]) - r["rss_before_load_mib"]
                                   for r in ok)
    if "decode_ms" in ok[0]:
        s["decode"] = min(r["decode_ms"] for r in ok)
        s["ttft"] = min(statistics.median(r["ttft_ms"]) for r in ok)
    if "throughput" in ok[0]:
        s["tps"] = max(_tps(r) for r in ok)
    return s


def _key(engine: str, file: str, threads: int, kind: str = "latency", dtype: str = "auto") -> str:
    return f"{engine}{' ' + dtype if engine == 'stagewise' else ''} | {file} | {threads}t | {kind}"


def _f(v, digits: int = 1) -> str:
    return PENDING if v is None else f"{v:.{digits}f}"


def _ratio(num, den, target: float | None, higher_is_better: bool = False) -> list[str]:
    if num is None or den is None:
        return [PENDING, PENDING if target else "—"]
    if num <= 0 or den <= 0:             # a decode difference lost in noise (a loaded machine)
        return ["invalid", "invalid"]
    r = num / den
    ok = r >= target if higher_is_better else r <= target if target else None
    return [f"{r:.2f}x", "—" if target is None else ("met" if ok else "NOT met")]


def speed_tables(saved: dict) -> list[str]:
    meta, res = saved["meta"], {k: best(v) for k, v in saved["results"].items()}
    get = lambda *a, **k: (res.get(_key(*a, **k)) or {})
    files = [f for f in meta["files"] if any(f" | {f} | " in k for k in res)]
    name = lambda f: LABELS.get(f, f"1B-class {f}" if f in QUANT_TYPES + ("BF16",) else f)
    decode, ttft, mem = [], [], []
    for f in files:
        info = meta["files"][f]
        for t in meta["threads"]:
            lc, sw = get("llamacpp", f, t).get("decode"), get("stagewise", f, t).get("decode")
            floor = info["decode_bytes"] / (meta["bandwidth_gbps"][str(t)] * 1e9) * 1e3
            decode.append([name(f), t, f"{info['decode_bytes'] / 1e6:.0f}", f"{floor:.1f}", _f(lc), _f(sw),
                           *_ratio(sw, lc, 1.0 if f in DECODE_TARGET else None)])
            lt, st = get("llamacpp", f, t).get("ttft"), get("stagewise", f, t).get("ttft")
            ttft.append([name(f), t, _f(lt, 0), _f(st, 0), *_ratio(st, lt, 0.7 if f != "BF16" else None)])
        lcm = [get("llamacpp", f, t) for t in meta["threads"] if get("llamacpp", f, t)]
        swm = [get("stagewise", f, t) for t in meta["threads"] if get("stagewise", f, t)]
        m = lambda runs, k: max((r[k] for r in runs if k in r), default=None)
        mem.append([name(f), f"{info['tensor_bytes'] / 2**20:.0f}", _f(m(lcm, "rss_after_load"), 0),
                    _f(m(lcm, "peak_rss"), 0), _f(m(swm, "rss_after_load"), 0), _f(m(swm, "peak_rss"), 0),
                    _f(m(swm, "load_delta"), 0), _ratio(m(swm, "load_delta"), info["tensor_bytes"] / 2**20, None)[0]])
    own = [[f"stagewise {d}", t, _f(get("stagewise", "checkpoint", t, dtype=d).get("decode")),
            _f(get("stagewise", "checkpoint", t, dtype=d).get("ttft"), 0),
            _f(get("stagewise", "checkpoint", t, dtype=d).get("rss_after_load"), 0),
            _f(get("stagewise", "checkpoint", t, dtype=d).get("peak_rss"), 0)]
           for d in ("auto", "bfloat16") for t in meta["threads"] if get("stagewise", "checkpoint", t, dtype=d)]
    offline = [(k, v) for k, v in res.items() if k.endswith("| offline") and v]
    own_tps = {k.split(" | ")[0]: v["tps"] for k, v in offline if " | checkpoint | " in k}
    own_ref = own_tps.get("stagewise auto") or own_tps.get("stagewise bfloat16")     # auto where it ran, else bf16
    off_rows = [[k.replace(" | offline", "").replace(" | ", ", "), f"{v['tps']:.1f}",
                 *(_ratio(v["tps"], own_ref, 1.2, True) if " | checkpoint | " not in k
                   else ["—", "—"])] for k, v in offline]
    bw = ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in meta["bandwidth_gbps"].items())
    return [
        "## Decode, batch 1 (ms/token)", "",
        f"Floor = bytes one step reads (every matrix; a tied embedding once, as the LM head) / read bandwidth "
        f"measured in this run ({bw}). Target: stagewise ≤ 1.0× llama.cpp on Q4_K_M, Q4_0, Q8_0 and the "
        "default model's Q4_1.", "",
        markdown_table(["file", "threads", "MB read / token", "bandwidth floor ms", "llama.cpp", "stagewise",
                        "stagewise / llama.cpp", "target ≤ 1.0×"], decode), "",
        "## TTFT of a fresh 512-token prompt (ms, median of the run's prompts)", "",
        markdown_table(["file", "threads", "llama.cpp", "stagewise", "stagewise / llama.cpp", "target ≤ 0.7×"], ttft),
        "", "## Memory (MiB; the engine's whole process tree)", "",
        "RSS after load: right after the engine is constructed. Peak: the highest of the tree sampled every "
        "0.2 s and the process's own high-water mark (VmHWM). llama.cpp maps the file (mapped pages count once "
        "touched). What loading added: RSS after load less the same process's RSS before the engine was made "
        "(Python, torch and its compiler imported): the weights as held, the KV pages touched, static graph buffers "
        "and compiled code. "
        "stagewise's KV cache is sized for one 2048-token context, as llama.cpp's n_ctx.", "",
        markdown_table(["file", "tensor MiB", "llama.cpp after load", "llama.cpp peak", "stagewise after load",
                        "stagewise peak", "stagewise: RSS loading added", "÷ tensor bytes"], mem), "",
        "## stagewise on the 1B model's bf16 HF checkpoint (its own path; `auto` is fp32 on CPUs without native "
        "bf16)", "", markdown_table(["engine", "threads", "decode ms/token", "TTFT 512 ms", "RSS after load MiB",
                                     "peak RSS MiB"], own) if own else PENDING, "",
        f"## Offline throughput, stagewise only ({meta['size']['n_req']} requests, prompts 32–256 tokens, "
        f"{meta['size']['out']} output tokens each, {max(meta['threads'])} threads)", "",
        markdown_table(["run", "output tok/s", "vs own checkpoint path (auto)", "target ≥ 1.2×"], off_rows)
        if off_rows else PENDING, ""]


def per_run_table(saved: dict) -> str:
    rows = []
    for k, rounds in saved["results"].items():
        ok = [r for r in rounds if "error" not in r]
        rows.append([k.replace(" | ", ", "), " / ".join(f"{r['decode_ms']:.1f}" for r in ok if "decode_ms" in r) or "—",
                     " / ".join(f"{statistics.median(r['ttft_ms']):.0f}" for r in ok if "ttft_ms" in r) or "—",
                     " / ".join(f"{_tps(r):.1f}" for r in ok if "throughput" in r) or "—",
                     " / ".join(f"{r['load_at_start'][0]:.1f}" for r in rounds), f"{len(ok)}/{len(rounds)}"])
    return markdown_table(["run", "decode ms/token", "TTFT 512 ms", "tok/s", "1-min load at start", "ok"], rows)


def header(meta: dict, title: str) -> list[str]:
    info = next((r.get("info") for rounds in meta.get("_results", {}).values() for r in rounds if r.get("info")), None)
    lb, la = meta["load_before"], meta.get("load_after") or [math.nan] * 3
    lines = [f"# {title}", "", f"CPU: {meta['cpu']}", "", f"{meta['machine']}. {meta['stagewise']}.",
             f"Load averages (1/5/15 min): {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f} at the start, "
             f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f} at the end (2 CPUs shared; an engine under test adds up to its "
             f"threads). Whole run {meta.get('wall_min', math.nan):.0f} min."]
    if info:
        lines.append(f"llama-cpp-python {info['version']}: `{info['system']}`.")
    lines += [""] + [f"- {n}" for n in meta.get("notes", [])]
    return lines


def speed_report(saved: dict) -> str:
    meta = dict(saved["meta"], _results=saved["results"])
    types = lambda v: ", ".join(f"{n} {t}" for t, n in v["types"].items())
    files = "; ".join(f"{LABELS.get(k, k)}: {v['file_bytes'] / 1e6:.0f} MB ({types(v)})"
                      for k, v in meta["files"].items())
    lines = header(meta, "stagewise vs llama.cpp on quantized GGUF files") + [
        "", "Files (made by `benchmarks/quantized/models.py`; tensor counts by type): " + files + ".", "",
        f"Same seeded token-id prompts, greedy, ignore_eos; each engine runs in its own process; {meta['rounds']} "
        f"round(s), the engines' order alternating, llama.cpp {meta['llamacpp_repeats']} run(s) per round; the best "
        "run is kept. Decode: (time for 1+n tokens − time for 1 token) / n on fresh 32-token prompts, "
        f"n = {meta['size']['decode_n']}. OpenMP wait policy: {meta.get('omp_wait_policy') or 'each engine its own'}.",
        ""]
    lines += speed_tables(saved) + ["## Per run", "", per_run_table(saved)]
    for k, rounds in saved["results"].items():
        for r in rounds:
            if "error" in r:
                lines += ["", f"**{k} failed**: {r['error']}", "", "```", r.get("log_tail", "")[-800:].strip(), "```"]
    if meta["quick"]:
        lines += ["", "_--quick smoke run: small workloads, one round; numbers not representative._"]
    return "\n".join(lines)


def numerics_report(saved: dict) -> str:
    from benchmarks.quantized import numerics as quantized_numerics
    meta = dict(saved["meta"], _results={})
    return "\n".join(header(meta, "Numerics of stagewise on quantized GGUF files")
                     + quantized_numerics.section(saved["numerics"], meta))


def plot(saved: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    meta, res = saved["meta"], {k: best(v) for k, v in saved["results"].items()}
    files = [f for f in meta["files"] if any(f" | {f} | " in k and "| latency" in k for k in res)]
    fig, axes = plt.subplots(1, len(meta["threads"]), figsize=(6 * len(meta["threads"]), 4.5), squeeze=False)
    for ax, t in zip(axes[0], meta["threads"]):
        for i, (engine, tag) in enumerate((("llamacpp", "llama.cpp"), ("stagewise", "stagewise"))):
            ys = [(res.get(_key(engine, f, t)) or {}).get("decode") or 0 for f in files]
            ax.bar([x + (i - 0.5) * 0.38 for x in range(len(files))], ys, 0.38, label=tag)
        floors = [meta["files"][f]["decode_bytes"] / (meta["bandwidth_gbps"][str(t)] * 1e9) * 1e3 for f in files]
        ax.scatter(range(len(files)), floors, marker="_", s=900, color="black", label="bandwidth floor", zorder=3)
        ax.set_xticks(range(len(files)), [LABELS.get(f, f).replace(" (its own file)", "") for f in files], fontsize=8)
        ax.set_ylabel("decode ms/token, batch 1 (lower is better)")
        ax.set_title(f"{t} thread(s)")
        ax.legend(fontsize=8)
    fig.suptitle("Batch-1 decode on quantized GGUF files (1B-class Llama; SmolLM2-135M)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(saved: dict, tag: str = "") -> None:
    """The report files; `tag` (a run on other files, e.g. the MoE shapes) names them apart."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    suffix = (f"-{tag}" if tag else "") + ("-quick" if saved["meta"]["quick"] else "")
    if saved["results"]:
        md, png = RESULTS_DIR / f"quantized{suffix}.md", RESULTS_DIR / f"quantized{suffix}.png"
        md.write_text(speed_report(saved).rstrip() + "\n")
        plot(saved, png)
        print(md.read_text())
        print(f"written to {md} and {png}")
    if saved["results"] or saved.get("numerics"):
        part = RESULTS_DIR / f"quantized{'' if saved['results'] else '-numerics'}-section{suffix}.md"
        part.write_text(quantized_section.section(saved, best, _key).rstrip() + "\n")
        print(f"the section for RESULTS.md: {part}")
    if saved.get("numerics"):
        md = RESULTS_DIR / f"quantized-numerics{suffix}.md"
        md.write_text(numerics_report(saved).rstrip() + "\n")
        print(md.read_text())
        print(f"written to {md}")
