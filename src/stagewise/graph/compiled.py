"""`compiled` backend: the whole stage body as one Inductor graph, fed from the static buffers.

Paged attention is the custom op `stagewise::paged_attention`, an opaque call inside the graph
(no graph break per layer), so norms, rotary, activations and residual adds fuse around it. The
op reads the step's live metadata from `live_metadata`, which replay sets around each call, so the
metadata (Python lists, per-step groups) is never traced or guarded on.

The token dimension is dynamic (unbacked): one compile serves every row count from 1 to the
capture cap, so replay needs no padding.
Inductor's on-disk caches live under the stagewise cache directory (`compile_cache_dir`).
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from ..model.attention import AttentionMetadata, ForwardBatch
from ..model.attention import paged_attention as _paged_attention
from .backend import Body, GraphBackend

log = logging.getLogger("stagewise.graph")
_live: list[AttentionMetadata | None] = [None]     # the metadata the op reads; set only by live_metadata


@contextmanager
def live_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Scope `meta` as the metadata every `paged_attention` call in the block reads."""
    if _live[0] is not None:
        raise RuntimeError("live_metadata is already set: compiled stage bodies do not nest.")
    _live[0] = meta
    try:
        yield
    finally:
        _live[0] = None


# NOTE: the op writes k/v into `kv_cache` but declares no mutation. Declaring it makes the
# functionalised graph copy the whole cache tensor back after each call; nothing else in the
# graph reads a cache, so there is no ordering for the compiler to keep. Defined through
# torch.library.Library rather than `custom_op`, so the dispatcher calls `paged_attention`
# directly, without custom_op's per-call checks (one call per layer per step).
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """`sdpa_paged_attention` on the scoped live metadata: q `[rows, Hq, D]` -> `[rows, Hq, D]`."""
    meta = _live[0]
    if meta is None:
        raise RuntimeError("paged_attention ran outside live_metadata; replay must scope the step's metadata.")
    return _paged_attention(meta, kv_cache, q, k, v, scale).contiguous()


_LIB = torch.library.Library("stagewise", "FRAGMENT")
_LIB.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor kv_cache, float scale) -> Tensor")
_LIB.impl("paged_attention", paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("stagewise::paged_attention")
def _(q, k, v, kv_cache, scale):
    return q.new_empty(q.shape)


def compile_cache_dir() -> str:
    """Where Inductor keeps compiled code between starts (keyed by graph, config and torch version)."""
    root = os.environ.get("STAGEWISE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "stagewise")
    return os.path.join(root, "inductor")


def use_compile_cache() -> str:
    """Point Inductor's caches at the stagewise cache directory unless the user chose one."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class CompiledBackend(GraphBackend):
    """Keys are `(rows, variant)`. `capture` compiles at the warm-up sizes; `adopt` registers a
    new row count on the already-compiled code without running it (the dynamic dimension)."""

    name = "compiled"
    dynamic_rows = True

    def __init__(self, live: ForwardBatch):
        super().__init__()
        self._batch = live
        use_compile_cache()

    def capture(self, key, body: Body) -> None:
        rows = f"1..{key[0]} rows"
        log.info("compiling the stage body for %s (Inductor; cached in %s after the first start) ...",
                 rows, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        t0 = time.perf_counter()
        assert self._batch.meta is not None, "capture runs on the dummy metadata"
        with live_metadata(self._batch.meta):
            body()      # compile (the row dimension is dynamic)
            body()      # and check the guards hold on a second call (no recompile at replay)
        log.info("compiled the stage body for %s in %.1f s", rows, time.perf_counter() - t0)
        self._graphs[key] = body

    def adopt(self, key, body: Body) -> None:
        self._graphs[key] = body

    def replay(self, key):
        assert self._batch.meta is not None, "the runner sets the step's metadata before a replay"
        with live_metadata(self._batch.meta):
            return self._graphs[key]()

    def attend(self, live, layer_id, q, k, v, scale):
        return torch.ops.stagewise.paged_attention(q, k, v, live.kv_caches[layer_id], scale)
