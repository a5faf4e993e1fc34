"""Prometheus metrics for one server, in its own CollectorRegistry.

Per-request counters and latency histograms are observed by the engine client as final outputs arrive
(on the event loop when the engine runs in its own process); engine state (queues, KV, prefix
cache, graph replays, stage busy time, which kernels run) is read at scrape time from the latest `stats()` snapshot
the engine published.
"""
from __future__ import annotations

from collections import Counter as _Tally
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# snapshot keys of gauges (state now, not totals since start)
DEAD_ZEROED = ("running", "waiting", "kv_usage", "stage_busy_fraction", "stage_bubble_fraction")


class ServerMetrics:
    """`snapshot()`: the engine's latest stats; `up()`: whether the engine still runs (a dead one's
    gauges read 0, its counters keep their totals)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str, max_model_len: int = 1 << 17,
                 up: Callable[[], bool] = lambda: True):
        disable_created_metrics()      # `*_created` series double the scrape and nobody graphs them
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.requests = Counter("stagewise_requests", "Requests by final status: a finish reason, rejected "
                                "(HTTP 4xx before reaching the engine) or overloaded (429: the waiting queue "
                                "was full).", ["model_name", "status"], registry=r)
        self.overloads = Counter("stagewise_overloaded_requests", "Requests refused with 429 by the waiting "
                                 "limit they met: 'server' (--max-waiting-requests) or 'api_key' "
                                 "(--max-waiting-requests-per-key; api_key is the key's place in --api-key, "
                                 "from 1).", ["model_name", "limit", "api_key"], registry=r)
        self.prompt_tokens = Counter("stagewise_prompt_tokens", "Prompt tokens of finished requests.",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("stagewise_generation_tokens", "Generated tokens of finished requests.",
                                         ["model_name"], registry=r).labels(**labels)
        self.embedding_requests = Counter("stagewise_embedding_requests", "Embedding requests that returned a "
                                          "vector (/v1/embeddings inputs, LLM.embed prompts).", ["model_name"],
                                          registry=r).labels(**labels)
        self.embedding_prompt_tokens = Counter("stagewise_embedding_prompt_tokens", "Prompt tokens of the embedding "
                                               "requests that returned a vector (also counted in "
                                               "stagewise_prompt_tokens).", ["model_name"],
                                               registry=r).labels(**labels)
        self.ttft = Histogram("stagewise_time_to_first_token_seconds", "Arrival to first generated token.",
                              ["model_name"], buckets=LATENCY_BUCKETS_S, registry=r).labels(**labels)
        self.tpot = Histogram("stagewise_time_per_output_token_seconds", "Mean time per generated token after "
                              "the first, per request.", ["model_name"], buckets=TPOT_BUCKETS_S,
                              registry=r).labels(**labels)
        self.e2e = Histogram("stagewise_e2e_request_latency_seconds", "Arrival to the final token.",
                             ["model_name"], buckets=LATENCY_BUCKETS_S, registry=r).labels(**labels)
        # vLLM's per-request histograms (its dashboard's token and phase panels)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram("stagewise_request_prompt_tokens", "Prompt tokens per finished "
                                                     "request.", tokens, labels)
        self.request_generation_tokens = self._histogram("stagewise_request_generation_tokens", "Generated tokens "
                                                         "per finished request.", tokens, labels)
        self.request_max_tokens = self._histogram("stagewise_request_params_max_tokens", "The max_tokens limit of "
                                                  "each finished request.", tokens, labels)
        phases = {"queue": "Arrival to first scheduled (waiting).",
                  "prefill": "First scheduled to first generated token (the prompt's computation).",
                  "decode": "First generated token to the last.",
                  "inference": "First scheduled to the last token (prefill + decode)."}
        self.phase_time = {phase: self._histogram(f"stagewise_request_{phase}_time_seconds", doc, PHASE_BUCKETS_S,
                                                  labels) for phase, doc in phases.items()}
        self.model_name = model_name
        self.key_waiting: Callable[[], dict[int, int]] = dict      # the server's: each API key's waiting requests
        r.register(_EngineCollector(snapshot, model_name, up))
        r.register(_KeyCollector(self))

    def _histogram(self, name: str, doc: str, buckets, labels: dict):
        return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(**labels)

    def observe_finished(self, out, num_prompt_tokens: int, now: float, max_tokens: int | None = None) -> None:
        """Called with a request's final output (`now`: time.monotonic() when the engine produced it)."""
        completion = out.outputs[0]
        self.requests.labels(self.model_name, completion.finish_reason or "unknown").inc()
        num_prompt = num_prompt_tokens or len(out.prompt_token_ids)
        self.prompt_tokens.inc(num_prompt)
        num_out = len(completion.token_ids)
        self.generation_tokens.inc(num_out)
        if getattr(out, "embedding", None) is not None:
            self.embedding_requests.inc()
            self.embedding_prompt_tokens.inc(num_prompt)
        arrival, first = out.metrics.get("arrival_time"), out.metrics.get("first_token_time")
        scheduled = out.metrics.get("scheduled_time")
        if completion.finish_reason in ("stop", "length"):      # requests that ran (not refused or aborted)
            self.request_prompt_tokens.observe(num_prompt)
            self.request_generation_tokens.observe(num_out)
            if max_tokens is not None:
                self.request_max_tokens.observe(max_tokens)
            self._observe_phases(arrival, scheduled, first, now)
        if arrival is None:
            return
        self.e2e.observe(max(0.0, now - arrival))
        if first is not None:
            self.ttft.observe(max(0.0, first - arrival))
            if num_out > 1:
                self.tpot.observe(max(0.0, now - first) / (num_out - 1))

    def _observe_phases(self, arrival, scheduled, first, now: float) -> None:
        if scheduled is None:
            return
        if arrival is not None:
            self.phase_time["queue"].observe(max(0.0, scheduled - arrival))
        self.phase_time["inference"].observe(max(0.0, now - scheduled))
        if first is not None:
            self.phase_time["prefill"].observe(max(0.0, first - scheduled))
            self.phase_time["decode"].observe(max(0.0, now - first))

    def reject(self) -> None:
        self.requests.labels(self.model_name, "rejected").inc()

    def overloaded(self, api_key: int | None = None) -> None:
        """A request refused with 429 because the waiting queue, or its API key's share, was full."""
        self.requests.labels(self.model_name, "overloaded").inc()
        self.overloads.labels(self.model_name, "server" if api_key is None else "api_key",
                              "" if api_key is None else str(api_key)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _KeyCollector:
    """Each API key's waiting requests (with --max-waiting-requests-per-key), by the key's place."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        counts = self.metrics.key_waiting()
        if counts:
            g = GaugeMetricFamily("stagewise_api_key_waiting_requests", "Sequences (prompts x n) of each API "
                                  "key waiting (read, tokenized or queued, not yet generating); api_key is the key's "
                                  "place in --api-key, from 1.", labels=["model_name", "api_key"])
            for place, count in sorted(counts.items()):
                g.add_metric([self.metrics.model_name, str(place)], float(count))
            yield g


class _EngineCollector:
    """Turns the engine's stats snapshot into metric families at scrape time."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str, up: Callable[[], bool] = lambda: True):
        self.snapshot, self.model_name, self.up = snapshot, model_name, up

    def describe(self):
        return []          # families vary with the snapshot; nothing to pre-register

    def collect(self):
        up, m = self.up(), self.model_name
        s = self.snapshot() or {}
        if not up:         # a dead engine's last state is not its state: its gauges read 0
            s = {k: v for k, v in s.items() if k not in DEAD_ZEROED}
            s["recovery"] = {**(s.get("recovery") or {}), "recovering": None, "spares_ready": 0}
        yield _gauge("stagewise_engine_up", "1 while the engine runs; 0 once it died (restart the server).", m,
                     1.0 if up else 0.0)
        yield _gauge("stagewise_num_requests_running", "Requests scheduled in the running batch.", m,
                     s.get("running", 0))
        yield _gauge("stagewise_num_requests_waiting", "Requests waiting to be scheduled.", m, s.get("waiting", 0))
        yield _gauge("stagewise_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).", m,
                     s.get("kv_usage", 0.0))
        yield _gauge("stagewise_num_kv_blocks", "KV cache blocks per stage.", m, s.get("num_kv_blocks", 0))
        # counters, not a ratio: rate(hits) / rate(queries) is the hit rate over any window
        yield _counter("stagewise_prefix_cache_queries", "Tokens looked up in the prefix cache.", m,
                       s.get("prefix_cache_queries", 0))
        yield _counter("stagewise_prefix_cache_hits", "Tokens looked up in the prefix cache and found there.", m,
                       s.get("prefix_cache_hits", 0))
        yield from _kv_disk_families(s, m)
        yield _counter("stagewise_num_preemptions", "Requests preempted (recomputed) for lack of KV blocks.", m,
                       s.get("num_preemptions", 0))
        yield _counter("stagewise_engine_steps", "Engine steps collected.", m, s.get("num_steps", 0))
        yield _iteration_tokens(s, m)
        yield from _graph_families(s, m)
        yield from _speculative_families(s.get("speculative"), m)
        busy = GaugeMetricFamily("stagewise_stage_busy_fraction", "Fraction of wall time since start each "
                                 "pipeline stage spent computing.", labels=["model_name", "stage"])
        for i, frac in enumerate(s.get("stage_busy_fraction", [])):
            busy.add_metric([m, str(i)], float(frac))
        yield busy
        # the counter form, so rate() gives the busy fraction over any window
        busy_s = CounterMetricFamily("stagewise_stage_busy_seconds", "Seconds each pipeline stage spent "
                                     "computing.", labels=["model_name", "stage"])
        for i, seconds in enumerate(s.get("stage_busy_s", [])):
            busy_s.add_metric([m, str(i)], float(seconds))
        yield busy_s
        comm_s = CounterMetricFamily("stagewise_stage_tp_comm_seconds", "Seconds of each stage's busy time its "
                                     "tensor-parallel rank 0 spent in all-reduces and gathers (waits for the other "
                                     "ranks included; absent without --tp-size).", labels=["model_name", "stage"])
        for i, seconds in enumerate(s.get("stage_tp_comm_s", [])):
            comm_s.add_metric([m, str(i)], float(seconds))
        yield comm_s
        yield from _balance_families(s, m)
        yield from _recovery_families(s.get("recovery") or {}, m)
        yield _kernel_info(s.get("kernels") or [], m)


KERNEL_LABELS = ("stage", "family", "impl", "isa", "op", "reason")


def _kernel_info(kernels: list[dict], m: str) -> GaugeMetricFamily:
    """Which kernel runs each family on each stage (kernels/report.py), one series of value 1 each."""
    family = GaugeMetricFamily("stagewise_kernel_info", "1 for each kernel family a stage runs: impl 'c' (stagewise's "
                               "C kernel; isa: its instruction-set path) or 'torch' (PyTorch's op `op`; reason: off, "
                               "not_built, no_kernel or device).", labels=["model_name", *KERNEL_LABELS])
    for k in kernels:
        family.add_metric([m, *(str(k.get(label, "")) for label in KERNEL_LABELS)], 1.0)
    return family


# the prefix cache's disk tier (docs/kv-cache.md), summed over the stages: (stats key, metric, help, counter?)
_KV_DISK = (
    ("bytes_written", "stagewise_kv_disk_written_bytes", "Bytes of KV pages the stages wrote to the disk tier.", True),
    ("bytes_read", "stagewise_kv_disk_read_bytes", "Bytes of KV pages the stages read back instead of recomputing.",
     True),
    ("pages_corrupt", "stagewise_kv_disk_corrupt_pages", "Pages dropped for a bad checksum or a torn write.", True),
    ("pages_evicted", "stagewise_kv_disk_evicted_pages", "Pages removed to stay within --kv-cache-disk.", True),
    ("pages_dropped", "stagewise_kv_disk_dropped_pages", "Pages not written because the writer was behind.", True),
    ("write_errors", "stagewise_kv_disk_write_errors", "Page writes that failed (a full disk turns writing off).",
     True),
    ("bytes_on_disk", "stagewise_kv_disk_bytes", "Bytes of KV pages on disk now.", False),
    ("budget_bytes", "stagewise_kv_disk_budget_bytes", "The disk tier's budget (0: off).", False),
)


def _kv_disk_families(s: dict, m: str):
    yield _counter("stagewise_prefix_cache_disk_queries", "Tokens looked up in the prefix cache's disk tier "
                   "(RAM misses).", m, s.get("prefix_cache_disk_queries", 0))
    yield _counter("stagewise_prefix_cache_disk_hits", "Tokens read from the disk tier instead of recomputed.", m,
                   s.get("prefix_cache_disk_hits", 0))
    tier = s.get("kv_disk") or {}
    for key, name, doc, counter in _KV_DISK:
        yield (_counter if counter else _gauge)(name, doc, m, tier.get(key, 0) or 0)


def _recovery_families(r: dict, m: str):
    """Pipeline rebuilds after a stage failure (README: When a stage fails)."""
    rebuilds = CounterMetricFamily("stagewise_pipeline_rebuilds", "Pipeline rebuilds after a stage died "
                                   "(stage_died), stopped answering (timeout) or lost a link (link), and on "
                                   "purpose when a node joined (node_returned) or left (node_leaving).",
                                   labels=["model_name", "cause"])
    for cause in sorted({"stage_died", "timeout", "link", *r.get("rebuilds", {})}):
        rebuilds.add_metric([m, cause], float(r.get("rebuilds", {}).get(cause, 0)))
    yield rebuilds
    yield _counter("stagewise_pipeline_recovered_requests", "Live requests requeued for recompute by a rebuild.",
                   m, r.get("recovered_requests", 0))
    yield _counter("stagewise_pipeline_poisoned_requests", "Requests failed because they were in flight during "
                   "two pipeline failures in a row.", m, r.get("poisoned_requests", 0))
    yield _counter("stagewise_pipeline_recovery_seconds", "Seconds from detecting a pipeline failure to the "
                   "first token after its rebuild, summed.", m, r.get("recovery_s", 0.0))
    yield _gauge("stagewise_pipeline_recovering", "1 while the pipeline is being rebuilt.", m,
                 1.0 if r.get("recovering") else 0.0)
    yield _gauge("stagewise_pipeline_spares_ready", "Started idle stage processes ready to replace a failed "
                 "stage.", m, r.get("spares_ready", 0))
    yield _gauge("stagewise_pipeline_nodes", "Nodes the pipeline runs on now.", m, len(r.get("nodes") or [0]))
    yield _counter("stagewise_pipeline_moves", "Changes of the nodes or the layer partition the pipeline runs on "
                   "(a node joined, left or was lost).", m, r.get("moves", 0))


def _balance_families(s: dict, m: str):
    """Pipeline balance: bubble fraction per stage, and predicted (cost model) vs measured compute shares."""
    per_stage = [("stagewise_stage_bubble_fraction", "stage_bubble_fraction", "Fraction of the time plans were in "
                  "flight that each pipeline stage spent not computing (bubble, transport, driver)."),
                 ("stagewise_stage_predicted_share", "stage_predicted_share", "Each stage's share of the compute "
                  "predicted by the partition's cost model."),
                 ("stagewise_stage_measured_share", "stage_measured_share", "Each stage's measured share of the "
                  "compute (busy seconds / all stages' busy seconds).")]
    for name, key, doc in per_stage:
        family = GaugeMetricFamily(name, doc, labels=["model_name", "stage"])
        for i, value in enumerate(s.get(key, [])):
            family.add_metric([m, str(i)], float(value))
        yield family
    # with stagewise_stage_busy_seconds, rate() gives the bubble fraction over any window
    yield _counter("stagewise_pipeline_active_seconds", "Seconds with at least one plan in flight.", m,
                   s.get("pipeline_active_s", 0.0))


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the model's context (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return buckets
            buckets.append(float(step * scale))
        scale *= 10


def _iteration_tokens(s: dict, m: str) -> HistogramMetricFamily:
    """Tokens per engine step (prefill chunks + decodes), from the engine's bucket counts."""
    h = s.get("iteration_tokens") or {}
    bounds, counts = h.get("buckets", []), h.get("counts", [])
    cumulative, running = [], 0
    for bound, count in zip([*bounds, float("inf")], counts or [0] * (len(bounds) + 1)):
        running += count
        cumulative.append(("+Inf" if bound == float("inf") else str(float(bound)), float(running)))
    family = HistogramMetricFamily("stagewise_iteration_tokens", "Tokens computed per engine step.",
                                   labels=["model_name"])
    family.add_metric([m], cumulative, float(h.get("sum", 0)))
    return family


def _graph_families(s: dict, m: str):
    replays = CounterMetricFamily("stagewise_graph_replays", "Steps that replayed a captured graph, by the "
                                  "graph (phase: the prefill or the decode graph; a decode step may replay the "
                                  "prefill graph) and bucket class (the padded token count rounded up to a power "
                                  "of two).", labels=["model_name", "phase", "bucket"])
    eager = CounterMetricFamily("stagewise_graph_eager_steps", "Steps run eagerly, by phase and reason.",
                                labels=["model_name", "phase", "reason"])
    padded = GaugeMetricFamily("stagewise_graph_padded_token_ratio", "Padding tokens / tokens computed in graph "
                               "replays.", labels=["model_name", "phase"])
    for phase in ("prefill", "decode"):
        g = s.get(f"{phase}_graph") or {}
        replayed_tokens, by_class = 0, _Tally[int]()
        for bucket, n in (g.get("replays") or {}).items():
            by_class[1 << (int(bucket) - 1).bit_length()] += int(n)
            replayed_tokens += int(bucket) * int(n)
        # NOTE: classes, not buckets: with dynamic rows every token count is a bucket (hundreds of series)
        for bucket_class, n in sorted(by_class.items()):
            replays.add_metric([m, phase, str(bucket_class)], float(n))
        for reason, n in (g.get("eager") or {}).items():
            eager.add_metric([m, phase, str(reason)], float(n))
        # replays are counted per padded bucket, so bucket x count is every token a replay computed
        padded.add_metric([m, phase], g.get("padded_tokens", 0) / replayed_tokens if replayed_tokens else 0.0)
    yield replays
    yield eager
    yield padded


def _speculative_families(spec: dict | None, m: str):
    """Speculative decoding (only when it is on): counters as vLLM's spec_decode_* names count them,
    plus the ratios since start."""
    if not spec:
        return
    yield _counter("stagewise_spec_decode_num_drafts", "Request-steps that carried draft tokens (verify steps).", m,
                   spec.get("verify_steps", 0))
    yield _counter("stagewise_spec_decode_num_draft_tokens", "Draft tokens proposed.", m, spec.get("proposed", 0))
    yield _counter("stagewise_spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, spec.get("accepted", 0))
    yield _gauge("stagewise_spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.", m,
                 spec.get("acceptance_rate", 0.0))
    yield _gauge("stagewise_spec_decode_mean_accepted_length", "Tokens per verify step (accepted drafts + 1) "
                 "since start.", m, spec.get("mean_accepted_length", 0.0))


def _gauge(name: str, doc: str, model_name: str, value) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric([model_name], float(value))
    return g


def _counter(name: str, doc: str, model_name: str, value) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric([model_name], float(value))
    return c
