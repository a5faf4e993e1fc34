"""Pipeline recovery bookkeeping for the supervisor (supervisor.py does the rebuild itself).

When a stage process dies, hangs past --dist-timeout-s or loses a link, the supervisor tears the
pipeline down, starts it again and recomputes every live request from its tokens. This module
holds what that needs beside it: the sliding-window restart budget, the poison-plan
rule (`Suspects`) and the counters `stats()` and /metrics report.
"""
from __future__ import annotations

import time
from collections import Counter, deque


def poison_message(strikes: int) -> str:
    times = "twice" if strikes == 2 else f"{strikes} times"
    return f"this request crashed the pipeline {times}; it was failed so that the other requests could go on."


class RestartBudget:
    """At most `limit` rebuilds within any `window_s` seconds."""

    def __init__(self, limit: int, window_s: float):
        self.limit, self.window_s = limit, window_s
        self.times: deque[float] = deque()

    def take(self) -> bool:
        """Use one rebuild; False if the window holds `limit` already."""
        now = time.monotonic()
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True

    def refusal(self, why: str) -> str:
        return (f"{why} The pipeline is not rebuilt again: it already was {len(self.times)} time(s) within "
                f"{self.window_s:.0f} s (--max-pipeline-restarts {self.limit}); fix the cause and restart.")


class Suspects:
    """The poison-plan rule. A request in flight when the pipeline fails gets a strike; a plan of
    it that completes clears them. After a rebuild, suspects are recomputed in groups that never
    share the pipeline with an earlier group still unconfirmed: requests without strikes run
    freely; then suspects that had generated tokens before (they ran fine until then); then new
    ones (never past their prompt); then each repeat suspect on its own. A request that fails the
    pipeline while it is the only suspect in flight, with a strike already, is poison: it fails
    alone and the rest go on. (Several repeat suspects in flight together get isolated instead.)"""

    def __init__(self) -> None:
        self.strikes: dict[str, int] = {}
        self.group: dict[str, int] = {}

    def crash(self, in_flight: list) -> dict[str, int]:
        """A failure with `in_flight` requests in flight; returns the poisoned ones' strike counts."""
        suspects_in_flight = [r for r in in_flight if r.request_id in self.strikes]
        for r in in_flight:
            self.strikes[r.request_id] = self.strikes.get(r.request_id, 0) + 1
        if len(suspects_in_flight) == 1:
            rid = suspects_in_flight[0].request_id
            return {rid: self.strikes.pop(rid)}
        return {}

    def regroup(self, live: list) -> None:
        """Recompute order after a rebuild, for the live requests (see the class)."""
        self.strikes = {r.request_id: self.strikes[r.request_id] for r in live if r.request_id in self.strikes}
        self.group = {}
        isolated = 3
        for r in live:
            n = self.strikes.get(r.request_id, 0)
            if n == 1:
                self.group[r.request_id] = 1 if r.output_token_ids else 2
            elif n > 1:
                self.group[r.request_id], isolated = isolated, isolated + 1

    def may_admit(self, req) -> bool:
        """Whether `req` may start now: no unconfirmed suspect of an earlier group is left."""
        g = self.group.get(req.request_id, 0)
        return g == 0 or all(h >= g for rid, h in self.group.items() if rid != req.request_id)

    def cleared(self, request_ids) -> None:
        """These requests completed a plan (or finished): no longer suspects."""
        if self.strikes or self.group:
            for rid in request_ids:
                self.strikes.pop(rid, None)
                self.group.pop(rid, None)


class RecoveryStats:
    """Counters of rebuilds (by cause), recovered and poisoned requests, and recovery time; `last`
    is the latest rebuild's breakdown in seconds."""

    def __init__(self) -> None:
        self.rebuilds: Counter = Counter()
        self.recovered_requests = 0
        self.poisoned_requests = 0
        self.recovery_s = 0.0
        self.last: dict = {}
        self.recovering: str | None = None          # why, while a rebuild is under way
        self._recompute_from: float | None = None   # the new pipeline's start, until its first token

    def lost(self, cause: str, why: str, num_live: int, num_poisoned: int) -> None:
        if self._recompute_from is not None:     # the previous recovery never saw a token
            self._done()
        self.rebuilds[cause] += 1
        self.recovering = why
        self.poisoned_requests += num_poisoned
        self.last = {"cause": cause, "why": why, "detected_at": time.monotonic(), "live_requests": num_live}

    def rebuilt(self, teardown_s: float, startup: dict, num_requeued: int) -> None:
        self.recovering = None
        self.recovered_requests += num_requeued
        self.last.update(teardown_s=teardown_s, rejoin_s=startup.get("rejoin_s", 0.0),
                         spawn_s=startup.get("spawn_s", 0.0), load_s=startup.get("load_s", 0.0),
                         stage_cpu_s=startup.get("stage_cpu_s", 0.0), requeued=num_requeued)
        self._recompute_from = time.monotonic()
        if not num_requeued:
            self._done()

    @property
    def recomputing(self) -> bool:
        """A rebuilt pipeline has not yet sampled its first token."""
        return self._recompute_from is not None

    def token_applied(self) -> None:
        """A plan sampled a token: the first after a rebuild ends that recovery."""
        if self._recompute_from is not None:
            self.last["recompute_s"] = time.monotonic() - self._recompute_from
            self._done()

    def _done(self) -> None:
        self._recompute_from = None
        total = time.monotonic() - self.last["detected_at"]
        self.last["total_s"] = total
        self.recovery_s += total

    def snapshot(self) -> dict:
        last = {k: v for k, v in self.last.items() if k != "detected_at"}
        return {"rebuilds": dict(self.rebuilds), "recovered_requests": self.recovered_requests,
                "poisoned_requests": self.poisoned_requests, "recovery_s": self.recovery_s,
                "recovering": self.recovering, "last": last}
