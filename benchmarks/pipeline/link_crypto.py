"""Sealed cluster links: what AES-256-GCM sealing costs, measured side by side with plain links.

1. Transport: one message (a decode step's proxy, [rows, hidden] fp32 hidden states + residual)
   sent and received on a loopback link pair in this process, sealed vs plain, per message.
2. PP=2 decode throughput: two offline engines (`LLM(pp_size=2)`) on the same tiny Llama, one
   sealed (the default) and one with sealing off in every one of its processes (a sitecustomize on
   PYTHONPATH sets `cluster.auth.SEAL_LINKS = False`: not a setting, the benchmark's baseline),
   rounds interleaved so drift on a shared machine hits both alike. Target: sealed within 2%.

    python -m benchmarks.pipeline link-crypto [--quick] [--rounds 4] [--num-requests 32]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..common import cpu_line, load_line, markdown_table, met, random_workload, temp_checkpoint, write_result
from ..engine_process import EngineProcess

TARGET = 0.98            # sealed decode throughput >= 98% of plain
VOCAB = 8192
PLAIN_SITE = "import stagewise.cluster.auth as _auth\n_auth.SEAL_LINKS = False\n"


def _link_pair(sealed: bool):
    """Two connected Links over loopback, through the real handshake (sealed or not)."""
    import queue
    import threading

    from stagewise.cluster import auth
    from stagewise.cluster.store import dial
    from stagewise.cluster.transport import Link
    auth.SEAL_LINKS = sealed
    key, got = auth.key_of("bench"), queue.SimpleQueue()
    listener = socket.create_server(("127.0.0.1", 0))
    gate = auth.Gate("bench", key, lambda sock, hello, peer, keys: got.put(Link(sock, "b", keys)))
    threading.Thread(target=gate.serve, args=(listener,), daemon=True).start()
    sock, keys = dial(*listener.getsockname(), key, auth.Hello(auth.RING, 1, 2, 0), "a", time.monotonic() + 10, 10)
    a, b = Link(sock, "a", keys), got.get(timeout=10)
    listener.close()
    auth.SEAL_LINKS = True
    return a, b


def transport(rows_list=(1, 32, 512), hidden=512, seconds=1.0) -> list[list]:
    """Per-message one-way time (send, then receive on the other end), sealed vs plain."""
    from stagewise.executor.messages import PlanMsg, recv_message, send_message
    from stagewise.plan import StepPlan
    out = []
    pairs = {sealed: _link_pair(sealed) for sealed in (False, True)}
    for rows in rows_list:
        proxy = {"hidden_states": torch.randn(rows, hidden), "residual": torch.randn(rows, hidden)}
        msg, per = PlanMsg(StepPlan(0, [], []), proxy), {}
        for _ in range(3):                                   # interleaved; best of three
            for sealed, (a, b) in pairs.items():
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds / 3:
                    send_message(a, msg)
                    recv_message(b, 10)
                    n += 1
                per[sealed] = min(per.get(sealed, 1e9), (time.perf_counter() - t0) / n)
        size = 2 * rows * hidden * 4
        out.append([rows, f"{size / 1024:.0f} KiB", f"{per[False] * 1e6:.0f}", f"{per[True] * 1e6:.0f}",
                    f"{(per[True] - per[False]) * 1e6:+.0f}"])
    for a, b in pairs.values():
        a.close(), b.close()
    return out


def _engine(model_dir, sealed: bool, site: Path) -> EngineProcess:
    saved = os.environ.get("PYTHONPATH")
    if not sealed:          # the engine process and every stage process it spawns inherit it
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site)] + ([saved] if saved else []))
    try:
        return EngineProcess(model_dir, dict(pp_size=2, threads_per_stage=1))
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _check_site(site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(site)}
    said = subprocess.run([sys.executable, "-c", "import stagewise.cluster.auth as a; print(a.SEAL_LINKS)"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert said == "False", f"the plain engine's sitecustomize did not take: {said!r}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=32)
    args = ap.parse_args(argv)
    model = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    out_len = (64, 64)
    if args.quick:
        args.rounds, args.num_requests, out_len = 2, 8, (16, 16)
    load_before = load_line()
    rows = transport(seconds=0.5 if args.quick else 1.5)
    print(markdown_table(["rows", "message", "plain µs", "sealed µs", "sealing"], rows), flush=True)
    walls: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as site, temp_checkpoint(**model) as model_dir:
        Path(site, "sitecustomize.py").write_text(PLAIN_SITE)
        _check_site(Path(site))
        engines = {sealed: _engine(model_dir, sealed, Path(site)) for sealed in (True, False)}
        try:
            for engine in engines.values():
                engine.ready()
            prompts, out_lens = random_workload(args.num_requests, (16, 32), out_len, VOCAB, seed=3)
            for r in range(args.rounds):
                for sealed in ((True, False) if r % 2 == 0 else (False, True)):
                    wall, _, _ = engines[sealed].run(prompts, out_lens)
                    walls[sealed].append(wall)
                    print(f"round {r}: {'sealed' if sealed else 'plain'}: {sum(out_lens) / wall:.1f} tok/s "
                          f"({load_line()})", flush=True)
        finally:
            for engine in engines.values():
                engine.close()
    tokens = sum(out_lens)
    best = {s: tokens / min(w) for s, w in walls.items()}
    mid = {s: tokens / statistics.median(w) for s, w in walls.items()}
    text = "\n".join([
        "# Sealed cluster links: cost", "",
        f"{cpu_line()}; {load_before} at the start, {load_line()} at the end (2 CPUs, shared).", "",
        "## One message on a loopback link (one-way, send + receive, best of 3)", "",
        markdown_table(["rows", "message (hidden + residual, fp32, hidden 512)", "plain µs", "sealed µs",
                        "sealing"], rows), "",
        f"## PP=2 decode, tiny Llama (hidden 512, 8 layers, vocab {VOCAB}, fp32), {args.num_requests} requests, "
        f"prompts 16–32, {out_len[0]} tokens each, {args.rounds} interleaved rounds", "",
        markdown_table(["links", "best tok/s", "median tok/s"],
                       [["plain", f"{best[False]:.1f}", f"{mid[False]:.1f}"],
                        ["sealed (default)", f"{best[True]:.1f}", f"{mid[True]:.1f}"]]), "",
        f"- sealed / plain, best rounds: **{best[True] / best[False]:.3f}** (target ≥ {TARGET}: "
        f"{met(best[True] / best[False], TARGET)}); medians: {mid[True] / mid[False]:.3f}",
    ])
    print(text)
    print(f"\nwritten to {write_result('link-crypto', text, args.quick)}")
    return 0
