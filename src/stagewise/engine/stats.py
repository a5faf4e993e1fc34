"""Engine counters: graph verdicts (counted by the driver, which decides them for all stages),
finished requests, and per-stage busy time. `snapshot()` is what `LLM.stats()` returns."""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter

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
    def __init__(self, policy):
        self.prefill = _GraphCounter(policy.backend, policy.buckets)
        self.decode = _GraphCounter(policy.decode_backend, policy.decode_buckets)
        self.finished: Counter = Counter()
        self.stage_busy_s: list[float] = []
        self.num_steps = 0
        self.started = time.monotonic()
        self.iteration_counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)     # the last: above every bucket
        self.iteration_tokens = 0

    def record_verdict(self, verdict, num_tokens: int) -> None:
        (self.decode if verdict.kind == "decode" else self.prefill).record(verdict, num_tokens)
        self.iteration_counts[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens += num_tokens

    def record_result(self, result) -> None:
        self.num_steps += 1
        if result.stage_busy_s:
            self.stage_busy_s = list(result.stage_busy_s)

    def record_finish(self, req) -> None:
        self.finished[req.finish_reason.value] += 1

    def snapshot(self, scheduler, executor) -> dict:
        wall = time.monotonic() - self.started
        return {
            "prefill_graph": self.prefill.snapshot(),
            "decode_graph": self.decode.snapshot(),
            "num_steps": self.num_steps,
            "num_preemptions": scheduler.num_preemptions,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "finished": dict(self.finished),
            "kv_usage": scheduler.blocks.usage,
            "num_kv_blocks": scheduler.blocks.num_blocks,
            "prefix_cache_hit_rate": scheduler.blocks.prefix_hit_rate,
            "prefix_cache_queries": scheduler.blocks.num_queried_tokens,
            "prefix_cache_hits": scheduler.blocks.num_hit_tokens,
            "stage_busy_s": list(self.stage_busy_s),
            "iteration_tokens": {"buckets": list(ITERATION_TOKEN_BUCKETS), "counts": list(self.iteration_counts),
                                 "sum": self.iteration_tokens},
            "stage_busy_fraction": [b / wall if wall > 0 else 0.0 for b in self.stage_busy_s],
        }
