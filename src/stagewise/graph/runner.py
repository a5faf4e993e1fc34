"""StageGraphRunner: everything about captured graphs for one pipeline stage.

Owns the static buffers, the prefill and decode backends, capture at startup, and per step:
fill -> replay -> trim (or the eager call when the driver's verdict says so), plus counters and
the byte counts the memory planner needs. It never decides graph vs eager: the verdict does.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import Any, Callable

import torch

from ..model.attention import AttentionMetadata, ForwardBatch
from ..parallel.partition import StageInfo
from ..parallel.proxy import ProxyTensors
from .backend import GraphBackend, GraphBatch, RerunBackend
from .background import CompileGate, compile_in_background
from .bind import bind_forward
from .buffers import StaticInputs
from .dummy import DummyMetadata
from .policy import GraphPolicy, GraphVerdict
from .static_attention import StaticAttentionMetadata, StaticForwardBatch
from .trim import trim_output

log = logging.getLogger("stagewise.graph")


class _Kind:
    """One graph kind of a stage (prefill or decode): its backend, buckets and counters."""

    def __init__(self, kind: str, name: str, buckets: tuple[int, ...], backend: GraphBackend | None,
                 full_slots: int):
        self.kind, self.name, self.buckets, self.backend = kind, name, tuple(buckets), backend
        self.full_slots = full_slots
        self.dynamic_rows = bool(getattr(backend, "dynamic_rows", False))   # any row count, no padding
        self.static_meta: StaticAttentionMetadata | None = None
        self.graph_batch: GraphBatch | None = None     # the live-attention batch all its bodies share
        self.replays: Counter = Counter()
        self.eager: Counter = Counter()
        self.padded_tokens = 0
        self.ready = True        # False while a background compile of this kind runs (steps run eager)

    def slots(self, bucket: int) -> int:
        """Request slots of a full graph: one per row for decode, the policy's count for prefill."""
        return bucket if self.kind == "decode" else min(self.full_slots, bucket)

    def stats(self) -> dict:
        return {"backend": self.name, "buckets": list(self.buckets), "replays": dict(self.replays),
                "eager": dict(self.eager), "padded_tokens": self.padded_tokens}


class StageGraphRunner:
    """Captured prefill/decode graphs of one stage. See `forward` for the per-step contract.

    Without CUDA, breakable/full run a CPU stand-in: by default `RerunBackend` (re-run the body on
    the static buffers, no extra memory); `emulator(rows, breakable=..., persistent=...)` replaces
    it (the tests pass an aten-op tape that freezes Python like a CUDA graph). `max_seq_len`
    bounds full graphs' block tables (default: the whole KV cache, correct but slow for static
    attention).
    """

    def __init__(self, model: torch.nn.Module, stage: StageInfo, policy: GraphPolicy, batch: ForwardBatch,
                 dtype: torch.dtype, device: torch.device | str, *, max_seq_len: int | None = None,
                 emulator: Callable[..., GraphBackend] | None = None):
        self.model: Any = model          # the model contract (README), duck-typed: embed_tokens, hidden_size, ...
        self.stage, self.policy, self.batch = stage, policy, batch
        self.dtype, self.device = dtype, torch.device(device)
        self.max_seq_len, self.emulator = max_seq_len, emulator
        # a stage that cannot take a proxy fails here, at start-up
        self.binding = bind_forward(model.forward, stage.rank, stage.is_first)
        self.variants = self._variants()
        self.inputs = self._make_inputs() if policy.enabled else None
        self._cuda: Any = None               # the CudaContext, made by the first CUDA backend
        self._gate = CompileGate()           # holds the background compile while a step runs
        self.decode_threads: int | None = None    # CPU: the decode steps' thread count (runtime/team.py)
        self._kinds = {"prefill": self._make_kind("prefill", policy.backend, policy.buckets),
                       "decode": self._make_kind("decode", policy.decode_backend, policy.decode_buckets)}
        self.capture_seconds = 0.0
        self._pool_bytes = 0
        for kind in self._kinds.values():
            if kind.backend is not None:
                log.info("stage %d: %s graphs %s via %s backend, buckets %s", stage.rank, kind.kind, kind.name,
                         kind.backend.name, list(kind.buckets))

    # construction
    def _variants(self) -> tuple[str, ...]:
        """Bodies per bucket: token ids and (if the forward takes them) embeddings on the first
        stage, because which input the body embeds is Python a graph freezes."""
        if not self.stage.is_first:
            return ("proxy",)
        return ("ids", "embeds") if self.binding.embeds_name else ("ids",)

    def _make_inputs(self, rows: int | None = None) -> StaticInputs:
        keys = tuple(getattr(self.model, "proxy_keys", ()) or ())
        if not self.stage.is_first and not keys:
            raise ValueError(f"Stage {self.stage.rank}'s model declares no proxy_keys, so its graphs cannot "
                             "allocate proxy buffers; set model.proxy_keys.")
        return StaticInputs(self.stage, rows or self.policy.max_rows, self.model.hidden_size, keys, self.dtype,
                            self.device, with_embeds=self.binding.embeds_name is not None)

    def _make_kind(self, kind: str, name: str, buckets: tuple[int, ...]) -> _Kind:
        backend = None if name == "off" else self._make_backend(name, few_rows=kind == "decode")
        return _Kind(kind, name, buckets, backend, self.policy.full_slots)

    def _make_backend(self, name: str, few_rows: bool) -> GraphBackend:
        if name == "compiled":
            from .compiled import CompiledBackend  # lazy: importing torch._dynamo costs seconds
            return CompiledBackend(self.batch, self.model, few_rows=few_rows)
        rows = self.policy.max_rows
        if self.device.type == "cuda" and not self.policy.emulated:
            from .cuda import CudaBreakableBackend, CudaContext, CudaFullBackend
            self._cuda = self._cuda or CudaContext(self.device)
            return (CudaBreakableBackend if name == "breakable" else CudaFullBackend)(self._cuda, rows)
        if self.emulator is not None:
            return self.emulator(rows, breakable=name == "breakable", persistent=self._persistent_tensors)
        return RerunBackend()

    def _persistent_tensors(self) -> list[torch.Tensor]:
        """Tensors that outlive every replay: what a captured body may legally read."""
        found = list(self.model.parameters()) + list(self.model.buffers())
        for module in self.model.modules():   # plain tensor attributes (precomputed tables)
            found.extend(v for v in vars(module).values() if isinstance(v, torch.Tensor))
        found.extend(c for c in self.batch.kv_caches if c is not None)
        found.extend(self.inputs.tensors() if self.inputs else [])
        for kind in self._kinds.values():
            if kind.static_meta is not None:
                found.extend(kind.static_meta.tensors())
        return found

    # capture
    def capture(self, background: bool = False) -> None:
        """Capture every bucket of every enabled kind, largest first (smaller ones reuse its pool).
        Needs the KV caches allocated: capture writes its dummy KV to scratch block 0.

        `background`: compiled (dynamic-rows) kinds compile on a thread instead, decode first;
        until a kind is ready its steps run eager (`wait_compiled` waits for them)."""
        kinds = [k for k in self._kinds.values() if k.backend is not None]
        if background:
            later = [k for k in kinds if k.dynamic_rows][::-1]      # decode, then prefill
            kinds = [k for k in kinds if not k.dynamic_rows]
            if later:
                compile_in_background(self, later, self._gate)
        if not kinds:
            return
        dummy = DummyMetadata(self._block_size(), self.device)
        mem0 = self._cuda.memory() if self._cuda else None
        t0 = time.perf_counter()
        saved = self.batch.meta
        try:
            with torch.inference_mode():
                for kind in kinds:
                    self._capture_kind(kind, dummy)
        finally:
            self.batch.meta = saved
        self.capture_seconds = time.perf_counter() - t0
        self._pool_bytes = self._measure_pool(mem0, kinds)
        log.info("stage %d: captured %s in %.1f s (graph memory %.1f MiB)", self.stage.rank,
                 ", ".join(f"{k.kind} {k.name} x{len(k.buckets) * len(self._kind_variants(k))}" for k in kinds),
                 self.capture_seconds, self._pool_bytes / 2**20)

    def step_scope(self) -> contextlib.AbstractContextManager:
        """Scope one step: a background compile waits until it ends (see graph/background.py)."""
        thread = self._gate.thread
        return self._gate.step() if thread is not None and thread.is_alive() else contextlib.nullcontext()

    def wait_compiled(self, timeout_s: float | None = None) -> bool:
        """Wait for a background compile; True when every kind is ready (or failed and runs eager)."""
        thread = self._gate.thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def _capture_kind(self, kind: _Kind, dummy: "DummyMetadata", background: bool = False) -> None:
        """Capture `kind`; `background` (compiled kinds): on scratch inputs and the dummy metadata
        passed down, so the steps the main thread runs meanwhile keep the shared buffers. Decode is
        captured with the thread count its steps run with (compiled code is guarded on it)."""
        threads = self.decode_threads if kind.kind == "decode" else None
        before = torch.get_num_threads()
        if threads and threads != before:
            torch.set_num_threads(threads)           # this thread's own OpenMP setting
        try:
            self._capture_kind_now(kind, dummy, background)
        finally:
            if threads and threads != before:
                torch.set_num_threads(before)

    def _capture_kind_now(self, kind: _Kind, dummy: "DummyMetadata", background: bool) -> None:
        backend = kind.backend
        inputs = self.inputs
        if background:
            # NOTE: made like self.inputs (outside inference mode: a normal tensor's dispatch keys),
            # else the compiled code's guards fail on the step's own buffers and it compiles again
            with torch.inference_mode(False):
                inputs = self._make_inputs(max(kind.buckets))
        assert backend is not None and inputs is not None, "capture runs only enabled kinds"
        if backend.static_attention:
            largest = max(kind.buckets)
            kind.static_meta = StaticAttentionMetadata(largest, kind.slots(largest), self._max_blocks(),
                                                       dummy.block_size, self.device)
        for bucket in sorted(kind.buckets, reverse=True):
            for variant in self._kind_variants(kind):
                key, meta = (bucket, variant), dummy.get(bucket)
                inputs.zero(bucket)
                if background:      # the compiled backend: it takes the metadata, and adopts the replay body
                    compiled: Any = backend
                    compiled.capture(key, self._body(kind, bucket, variant, True, inputs), meta=meta)
                    compiled.adopt(key, self._body(kind, bucket, variant))
                    continue
                self.batch.meta = meta
                if kind.static_meta is not None:
                    kind.static_meta.reset()
                backend.capture(key, self._body(kind, bucket, variant, mark_dynamic=True))

    def _kind_variants(self, kind: _Kind) -> tuple[str, ...]:
        """A dynamic-rows (compiled) first stage embeds token ids eagerly and compiles the
        embeddings body only: one graph fewer to compile, and mixed steps need no second one."""
        if kind.dynamic_rows and self.stage.is_first and self.binding.embeds_name:
            return ("embeds",)
        return self.variants

    def _body(self, kind: _Kind, bucket: int, variant: str, mark_dynamic: bool = False,
              inputs: StaticInputs | None = None):
        inputs = inputs or self.inputs
        assert inputs is not None and kind.backend is not None, "bodies exist only for enabled kinds"
        views = inputs.views(bucket)
        ids = views["input_ids"] if variant == "ids" else None
        kwargs = self.binding.kwargs(views["input_embeds"] if variant == "embeds" else None, views["proxy"])
        positions, model = views["positions"], self.model
        batch: GraphBatch
        if kind.static_meta is not None:
            batch = StaticForwardBatch(self.batch, kind.static_meta, bucket, kind.slots(bucket))
        else:
            kind.graph_batch = kind.graph_batch or GraphBatch(self.batch, kind.backend.attend)
            batch = kind.graph_batch
        if kind.dynamic_rows:
            backend: Any = kind.backend      # the compiled backend: its own torch.compile of the model
            model = backend.model
            if mark_dynamic:
                backend.mark_rows([views["positions"], views["input_ids"], views["input_embeds"],
                                   *(views["proxy"].tensors.values() if views["proxy"] is not None else ())])

        def body():
            return model(ids, positions, batch, **kwargs)
        return body

    def _block_size(self) -> int:
        cache = next((c for c in self.batch.kv_caches if c is not None), None)
        if cache is None:
            raise RuntimeError(f"Stage {self.stage.rank}: allocate the KV caches before capturing graphs.")
        return cache.shape[2]

    def _max_blocks(self) -> int:
        cache = next(c for c in self.batch.kv_caches if c is not None)
        num_blocks, block_size = cache.shape[1], cache.shape[2]
        if self.max_seq_len is None:
            return num_blocks
        return min(num_blocks, -(-self.max_seq_len // block_size))

    def _measure_pool(self, mem0, kinds) -> int:
        if self._cuda is not None:
            free0, reserved0 = mem0
            free1, reserved1 = self._cuda.memory()
            return max(reserved1 - reserved0, free0 - free1, 0)
        held = {id(t): t for k in kinds for t in k.backend.persistent_tensors()}   # bridges, outputs
        return sum(k.backend.pool_bytes() for k in kinds) + sum(t.numel() * t.element_size() for t in held.values())

    # per step
    def forward(self, verdict: GraphVerdict | None, input_ids: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, input_embeds: torch.Tensor | None = None,
                proxy: ProxyTensors | None = None) -> Any:
        """Run one step: replay `verdict.bucket`, or eager when it is None. Returns T rows.

        NOTE: a replayed non-last stage returns views of graph memory that the next forward on
        this stage overwrites: send or copy them first. The last stage's hidden rows likewise.
        """
        self.batch.meta = meta
        if not self.will_replay(verdict):
            return self._eager(verdict, input_ids, positions, input_embeds, proxy)
        assert verdict is not None and verdict.bucket is not None, "will_replay implies a bucket"
        kind = self._kinds[verdict.kind]
        T, B = meta.num_tokens, verdict.bucket
        if kind.dynamic_rows:
            input_ids, input_embeds = self._dynamic_inputs(kind, B, input_ids, input_embeds)
        key = (B, self._variant(input_embeds))
        if kind.backend is None or not kind.backend.can_replay(key):
            raise RuntimeError(f"Stage {self.stage.rank}: the verdict asks for a {verdict.kind} graph of bucket {B} "
                               f"({key[1]}) that this stage did not capture; stages must share one policy.")
        if kind.name == "full" and len(meta.query_lens) > kind.slots(B):
            raise RuntimeError(f"Stage {self.stage.rank}: a full graph of bucket {B} has {kind.slots(B)} request "
                               f"slots but the step has {len(meta.query_lens)} requests; the verdict should "
                               "have been 'unservable' (eager).")
        assert self.inputs is not None, "a replay verdict implies graphs are enabled"
        with torch.inference_mode():
            self.inputs.fill(T, B, input_ids, positions, input_embeds, proxy)
            if kind.static_meta is not None:
                kind.static_meta.fill(meta, B, kind.slots(B))
            out = kind.backend.replay(key)
        kind.replays[B] += 1
        kind.padded_tokens += B - T
        return trim_output(out, T)

    def _dynamic_inputs(self, kind: _Kind, rows: int, input_ids, input_embeds):
        """Embed ids eagerly where the kind compiled the embeddings body; register `rows` on the
        compiled code the first time a step has that many."""
        if self._kind_variants(kind) == ("embeds",) and input_embeds is None:
            input_ids, input_embeds = None, self.model.embed_tokens(input_ids)     # [T, H]
        key = (rows, self._variant(input_embeds))
        if kind.backend is not None and not kind.backend.can_replay(key):
            backend: Any = kind.backend      # a dynamic-rows backend: it adopts new row counts
            backend.adopt(key, self._body(kind, rows, key[1]))
        return input_ids, input_embeds

    def _variant(self, input_embeds) -> str:
        if not self.stage.is_first:
            return "proxy"
        return "embeds" if input_embeds is not None else "ids"

    def will_replay(self, verdict: GraphVerdict | None) -> bool:
        """Whether `forward` replays this verdict's graph: it names a bucket, and the graph is not
        still compiling (a dynamic-rows graph pads nothing, so running eager instead is safe)."""
        return verdict is not None and verdict.bucket is not None and self._kinds[verdict.kind].ready

    def _eager(self, verdict, input_ids, positions, input_embeds, proxy) -> Any:
        kind = self._kinds[verdict.kind if verdict is not None else "prefill"]
        why = "compiling" if verdict is not None and verdict.bucket is not None else None
        kind.eager[why or (verdict.reason if verdict is not None and verdict.reason else "no_verdict")] += 1
        kwargs = self.binding.kwargs(input_embeds, proxy)
        with torch.inference_mode():
            return self.model(input_ids, positions, self.batch, **kwargs)

    # reporting
    def stats(self, kind: str = "prefill") -> dict:
        """`{"backend", "buckets", "replays": {bucket: n}, "eager": {reason: n}, "padded_tokens"}`
        for `kind` "prefill" or "decode" (one runner serves both)."""
        return self._kinds[kind].stats()

    def static_bytes(self) -> int:
        """Static input/proxy/embedding buffers (known at construction), plus full graphs'
        static metadata once captured."""
        total = self.inputs.nbytes() if self.inputs else 0
        return total + sum(k.static_meta.nbytes() for k in self._kinds.values() if k.static_meta is not None)

    def graph_pool_bytes(self) -> int:
        """Memory captured graphs hold (CUDA: measured around capture; includes bridges and
        output buffers). 0 before `capture()`."""
        return self._pool_bytes
