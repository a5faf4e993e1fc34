"""The speculation case of the elastic benchmark: per-user decode (one request at a time, greedy)
over 2 (and 4, where the machine has the CPUs) nodes of one CPU each at 20 ms links, with and
without speculation: n-gram prompt lookup, and a draft model of the same tokenizer beside the
driver when --spec-draft-model names one. A verify step carries k drafts through the pipeline in
one pass, so the link is paid once per accepted run instead of once per token. Workloads: the
copy-heavy and the fresh chats of benchmarks/offline/speculative.py. Targets (issue 61): >= 2x
without speculation on the copy-heavy chat, >= 1.0x on fresh text.

Each run is `stagewise generate --prompt ... --max-tokens N` on node 0 (the other nodes take the
worker role), which prints its tokens/s; the greedy texts with and without speculation are compared.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

from benchmarks.harness.cluster import NodeSpec
from benchmarks.offline.speculative import COPY_TASKS, FRESH_TASKS

GEN_RE = re.compile(r"(\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\)")
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TARGETS = {"copy-heavy": 2.0, "fresh": 1.0}


def methods(args) -> list[tuple[str, list[str]]]:
    out = [("none", []), ("ngram", ["--speculative-config", json.dumps(NGRAM)])]
    if args.spec_draft_model:
        draft = {"method": "draft_model", "model": args.spec_draft_model, "num_speculative_tokens": args.spec_k}
        out.append(("draft_model", ["--speculative-config", json.dumps(draft)]))
    return out


def speculation(args, quiet, log_dir, run: Callable[..., tuple[str, str]],
                loadavg: Callable[[], list[float]]) -> list[dict]:
    """Every (nodes, workload, method) once; speed-ups against no speculation on the same nodes."""
    workloads = {"copy-heavy": COPY_TASKS[:args.spec_prompts], "fresh": FRESH_TASKS[:args.spec_prompts]}
    rows = []
    for n in args.spec_nodes:
        if n > (os.cpu_count() or 1):
            print(f"  speculation on {n} nodes left out: it needs {n} CPUs, this machine has {os.cpu_count()}")
            continue
        specs = [NodeSpec(cpus=str(i), delay_ms=args.spec_delay_ms) for i in range(n)]
        for wname, prompts in workloads.items():
            base, base_text = None, None
            for mname, flags in methods(args):
                case = f"{n} nodes x 1 CPU, PP={n}, {args.spec_delay_ms:g} ms, {wname}, {mname}"
                load = quiet.wait(f"speculation: {case}")
                extra = [f for p in prompts for f in ("--prompt", p)] + ["--max-tokens", str(args.spec_max_tokens),
                                                                         "--chat", *flags]
                out, err = run(args, specs, n, "generate", extra, log_dir, f"spec-{n}-{wname}-{mname}")
                match = GEN_RE.search(err)
                if match is None:
                    raise RuntimeError(f"speculation {case}: generate printed no tokens/s: {err[-500:]}")
                row = {"case": case, "nodes": n, "workload": wname, "method": mname, "tok_s": float(match.group(3)),
                       **load, "load_after": loadavg()}
                if mname == "none":
                    base, base_text = row["tok_s"], out
                else:
                    row["speedup"] = round(row["tok_s"] / base, 3) if base else None
                    row["target"] = TARGETS[wname]
                    row["same_text"] = out == base_text
                shown = (f" ({row['speedup']:.2f}x, target {row['target']}, same text {row['same_text']})"
                         if row.get("speedup") else "")
                print(f"  {case}: {row['tok_s']:.1f} tok/s{shown}", flush=True)
                rows.append(row)
    return rows


def add_args(ap) -> None:
    ap.add_argument("--spec-nodes", default="2,4", help="node counts of the speculation case (one CPU each)")
    ap.add_argument("--spec-delay-ms", type=float, default=20.0, help="one-way link delay of the speculation case")
    ap.add_argument("--spec-prompts", type=int, default=4, help="prompts per workload (run one after another)")
    ap.add_argument("--spec-max-tokens", type=int, default=128)
    ap.add_argument("--spec-draft-model", default=None, help="a draft model of the same tokenizer (default: none)")
    ap.add_argument("--spec-k", type=int, default=4, help="drafts per verify step of the draft model")


def parse(args) -> None:
    args.spec_nodes = [int(x) for x in str(args.spec_nodes).split(",") if x]
