"""`compiled` backend: the whole stage body as one Inductor graph, fed from the static buffers.

Paged attention is the custom op `stagewise::paged_attention`, an opaque call inside the graph
(no graph break per layer), so norms, rotary, activations and residual adds fuse around it. The
op reads the step's live metadata from `live_metadata`, which replay sets around each call, so the
metadata (Python lists, per-step groups) is never traced or guarded on.

The token dimension is dynamic (unbacked): one compile serves every row count from 1 to the
capture cap, so replay needs no padding.
Inductor's on-disk caches live under the stagewise cache directory (`compile_cache.py`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from ..model.attention import AttentionMetadata, ForwardBatch
from ..model.attention import paged_attention as _paged_attention
from . import compile_cache
from .backend import Body, GraphBackend

log = logging.getLogger("stagewise.graph")
# NOTE: per thread: a graph may compile on a background thread while steps replay another one
_live = threading.local()     # .meta: the metadata the op reads; set only by live_metadata


@contextmanager
def live_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Scope `meta` as the metadata every `paged_attention` call in the block (on this thread) reads."""
    if getattr(_live, "meta", None) is not None:
        raise RuntimeError("live_metadata is already set: compiled stage bodies do not nest.")
    _live.meta = meta
    try:
        yield
    finally:
        _live.meta = None


# NOTE: the op writes k/v into `kv_cache` but declares no mutation. Declaring it makes the
# functionalised graph copy the whole cache tensor back after each call; nothing else in the
# graph reads a cache, so there is no ordering for the compiler to keep. Defined through
# torch.library.Library rather than `custom_op`, so the dispatcher calls `paged_attention`
# directly, without custom_op's per-call checks (one call per layer per step).
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`sdpa_paged_attention` on the scoped live metadata: q `[rows, Hq, D]` -> `[rows, Hq, D]`."""
    meta = getattr(_live, "meta", None)
    if meta is None:
        raise RuntimeError("paged_attention ran outside live_metadata; replay must scope the step's metadata.")
    return _paged_attention(meta, kv_cache, q, k, v, scale).contiguous()


_LIB = torch.library.Library("stagewise", "FRAGMENT")
_LIB.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, float scale) -> Tensor")
_LIB.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("stagewise::paged_attention")
def _(q, k, v, kv_cache, scale):
    return q.new_empty(q.shape)


class CompiledBackend(GraphBackend):
    """Keys are `(rows, variant)`. `capture` compiles at the warm-up sizes; `adopt` registers a
    new row count on the already-compiled code without running it (the dynamic dimension).

    `few_rows`: a compile for steps of a few rows (decode batches): its rows are hinted at one and
    its loops generated serial, so a one-row RMSNorm does not open an OpenMP parallel region (the
    default hint of 8192 rows makes Inductor parallelise every fused loop).

    Guards: Dynamo checks, before every replay, the guards it installed at compile time; ~85% of
    them (hooks dicts, attribute types, parameters' shapes: ~140 per layer) are on the model's
    modules, which nothing changes once a stage is built (weights load, and tensor-parallel hooks
    attach, before the first compile). Those are not installed, so a replay checks only the
    inputs, the globals and the grad mode (a few dozen, whatever the depth)."""

    name = "compiled"
    dynamic_rows = True

    def __init__(self, live: ForwardBatch, model: torch.nn.Module, few_rows: bool = False):
        super().__init__()
        self._batch = live
        self.few_rows = few_rows
        compile_cache.claim()
        # NOTE: a torch.compile object of its own: Dynamo keys its cache entries by backend, so the
        # two kinds' graphs of one model never stand in for each other.
        options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if few_rows:
            options["cpp.threads"] = 1
        self.model = torch.compile(model, dynamic=None, options=options)

    def mark_rows(self, tensors: list[torch.Tensor | None]) -> None:
        """Mark the row dimension of the capture inputs unbacked.

        NOTE: unbacked, not merely dynamic: Dynamo specialises a backed size of 1, so batch-1
        decode would need a second graph (or pad to 2 rows, which sends fp32 GEMMs from MKL's GEMV
        to its packing GEMM: measured 1.6x slower per token). Unbacked sizes serve 1..cap with one
        graph, and the GEMM kernels still see the real row count at run time."""
        for t in tensors:
            if t is not None:
                torch._dynamo.decorators.mark_unbacked(t, 0, hint_override=1 if self.few_rows else None)

    def capture(self, key, body: Body, meta: AttentionMetadata | None = None) -> None:
        what = f"the {'few-rows' if self.few_rows else 'stage'} body for 1..{key[0]} rows"
        log.info("compiling %s (Inductor; cached in %s after the first start) ...",
                 what, os.environ.get(compile_cache.VAR))
        t0 = time.perf_counter()
        meta = meta if meta is not None else self._batch.meta
        assert meta is not None, "capture runs on the dummy metadata"
        with live_metadata(meta):
            try:
                body()      # compile (the row dimension is dynamic)
            except Exception as exc:
                broken = compile_cache.broken_library(exc)
                if broken is None:
                    raise
                log.warning("Inductor's cache held a broken library (%s: a compile killed while writing it); "
                            "removed it and compiling again", broken)
                broken.unlink()
                body()
            body()      # and check the guards hold on a second call (no recompile at replay)
        log.info("compiled %s in %.1f s", what, time.perf_counter() - t0)
        self._graphs[key] = body

    def adopt(self, key, body: Body) -> None:
        self._graphs[key] = body

    def replay(self, key):
        assert self._batch.meta is not None, "the runner sets the step's metadata before a replay"
        with live_metadata(self._batch.meta):
            return self._graphs[key]()

    def attend(self, live, layer_id, q, k, v, scale):
        return torch.ops.stagewise.paged_attention(q, k, v, live.kv_caches[layer_id], scale)
