"""Engine counters: graph verdicts (counted by the driver, which decides them for all stages),
finished requests, per-stage busy time, and pipeline balance: each stage's bubble fraction (the
share of the time plans were in flight that the stage spent not computing) and its predicted
(cost model) vs measured share of the compute, the prefix cache per tier (RAM, and the disk
tier's per-stage counters as the last plan brought them), and which kernels each stage runs
(`kernels`: kernels/report.py). `snapshot()` is what `LLM.stats()` returns."""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter

from ..kernels.report import as_dicts
from ..kvcache.disk_tier import COUNTERS as KV_DISK_COUNTERS

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)   # vLLM's


class _GraphCounter:
    def __init__(self, backend: str, buckets):
        self.backend, self.buckets = backend, list(buckets)
        self.replays: Counter = Counter()
        self.eager: Counter = Counter()
        self.padded_tokens = 0

    def record(self, verdict, num_tokens: int) -> None:
        if verdict.bucket is None:
            self.eager[verdict.reason or "eager"] += 1
        else:
            self.replays[verdict.bucket] += 1
            self.padded_tokens += verdict.bucket - num_tokens

    def snapshot(self) -> dict:
        return {"backend": self.backend, "buckets": list(self.buckets), "replays": dict(self.replays),
                "eager": dict(self.eager), "padded_tokens": self.padded_tokens}


class EngineStats:
    def __init__(self, policy, predicted_shares: list[float] | None = None, busy_base: list[float] | None = None):
        self.prefill = _GraphCounter(policy.backend, policy.buckets)
        self.decode = _GraphCounter(policy.decode_backend, policy.decode_buckets)
        self.finished: Counter = Counter()
        self.stage_busy_s: list[float] = []
        self.stage_comm_s: list[float] = []           # of which tensor-parallel collectives (rank 0 of each stage)
        self.busy_base = list(busy_base or [])        # busy clocks before the first request (start-up profile)
        self.predicted_shares = list(predicted_shares or [])
        self.num_steps = 0
        self.started = time.monotonic()
        self.iteration_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)     # the last: above every bucket
        self.iteration_tokens = 0
        self.active_s = 0.0                           # wall time with at least one plan in flight
        self.active_since: float | None = None
        self.busy_offset: list[float] = []            # busy seconds of stage processes that were replaced
        self.comm_offset: list[float] = []
        self.kv_disk: list[list[int]] = []            # each stage's disk-tier counters (KV_DISK_COUNTERS order)
        self._kernels: tuple[object, list[dict]] = (None, [])    # (an executor's report, as dicts)

    def pipeline_started(self) -> None:
        self.active_since = time.monotonic()

    def active_seconds(self) -> float:
        """Wall time with at least one plan in flight, so far."""
        return self.active_s + (time.monotonic() - self.active_since if self.active_since is not None else 0.0)

    def pipeline_drained(self) -> None:
        if self.active_since is not None:
            self.active_s += time.monotonic() - self.active_since
            self.active_since = None

    def balance(self) -> dict:
        """Bubble fraction per stage (1 - compute / time in flight), and each stage's measured share of
        the compute next to the cost model's prediction (`predicted_stage_busy_s`: the measured total
        split as predicted)."""
        active = self.active_seconds()
        base = self.busy_base or [0.0] * len(self.stage_busy_s)
        busy = [b - b0 for b, b0 in zip(self.stage_busy_s, base)]
        total = sum(busy)
        return {
            "pipeline_active_s": active,
            "stage_bubble_fraction": [max(0.0, 1 - b / active) if active > 0 else 0.0 for b in busy],
            "stage_measured_share": [b / total if total > 0 else 0.0 for b in busy],
            "stage_predicted_share": list(self.predicted_shares),
            "predicted_stage_busy_s": [p * total for p in self.predicted_shares] if busy else [],
            "measured_stage_busy_s": busy,
        }

    def record_verdict(self, verdict, num_tokens: int) -> None:
        (self.decode if verdict.kind == "decode" else self.prefill).record(verdict, num_tokens)
        self.iteration_counts[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens += num_tokens

    def record_result(self, result) -> None:
        self.num_steps += 1
        if result.kv_tier:
            self.kv_disk = [list(c) for c in result.kv_tier]
        if result.stage_busy_s:
            offset = self.busy_offset or [0.0] * len(result.stage_busy_s)
            self.stage_busy_s = [o + b for o, b in zip(offset, result.stage_busy_s)]
        if result.stage_comm_s:
            offset = self.comm_offset or [0.0] * len(result.stage_comm_s)
            self.stage_comm_s = [o + c for o, c in zip(offset, result.stage_comm_s)]

    def pipeline_rebuilt(self) -> None:
        """New stage processes count busy time from 0; keep the counters growing."""
        self.busy_offset = list(self.stage_busy_s)
        self.comm_offset = list(self.stage_comm_s)

    def record_finish(self, req) -> None:
        self.finished[req.finish_reason.value] += 1

    def kv_disk_snapshot(self) -> dict:
        """The disk tier: each stage's counters by name, and their sums over the stages."""
        stages = [dict(zip(KV_DISK_COUNTERS, c)) for c in self.kv_disk]
        totals = {k: sum(st[k] for st in stages) for k in KV_DISK_COUNTERS if k not in ("enabled", "writable")}
        return {"enabled": bool(stages) and all(st["enabled"] for st in stages),
                "writable": bool(stages) and all(st["writable"] for st in stages), **totals, "stages": stages}

    def kernels(self, executor) -> list[dict]:
        """Which kernels each stage runs (kernels/report.py), as each stage reported it at start-up."""
        report = executor.kernels
        if self._kernels[0] is not report:           # a rebuilt pipeline reports its own
            self._kernels = (report, as_dicts(report))
        return self._kernels[1]

    def snapshot(self, scheduler, executor) -> dict:
        wall = time.monotonic() - self.started
        return {
            "prefill_graph": self.prefill.snapshot(),
            "decode_graph": self.decode.snapshot(),
            "num_steps": self.num_steps,
            "num_preemptions": scheduler.num_preemptions,
            "prefill_chunks_overlapped": scheduler.num_overlapped_chunks,
            "max_plans_per_request": scheduler.max_plans_per_request,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "finished": dict(self.finished),
            "kv_usage": scheduler.blocks.usage,
            "num_kv_blocks": scheduler.blocks.num_blocks,
            "prefix_cache_hit_rate": scheduler.blocks.prefix_hit_rate,
            "prefix_cache_queries": scheduler.blocks.num_queried_tokens,
            "prefix_cache_hits": scheduler.blocks.num_hit_tokens,
            "prefix_cache_disk_queries": scheduler.blocks.num_disk_queried_tokens,
            "prefix_cache_disk_hits": scheduler.blocks.num_disk_hit_tokens,
            "kv_disk": self.kv_disk_snapshot(),
            "stage_busy_s": list(self.stage_busy_s),
            "stage_tp_comm_s": list(self.stage_comm_s),
            "iteration_tokens": {"buckets": list(ITERATION_TOKEN_BUCKETS), "counts": list(self.iteration_counts),
                                 "sum": self.iteration_tokens},
            "stage_busy_fraction": [b / wall if wall > 0 else 0.0 for b in self.stage_busy_s],
            "kernels": self.kernels(executor),
            **self.balance(),
        }
