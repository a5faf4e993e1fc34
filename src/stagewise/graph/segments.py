"""Segmented capture, shared by the CUDA backends and the CPU tape emulator.

A body runs once under capture; with `breakable` every attention call closes the open segment,
runs attention eagerly on bridge buffers, keeps a closure that re-runs it with the live metadata
at replay, and opens the next segment. Without `breakable` (full graphs) the whole
body is one segment. Subclasses say what a segment is (a CUDAGraph, an aten-op tape).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..model.attention import ForwardBatch
from .backend import Body, Bridges, GraphBackend, OutputBuffers, live_attention


class Segment:
    """One recorded stretch of the body: begin/end around the capture, replay afterwards."""

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def replay(self) -> None: ...


class SegmentedGraph:
    """L+1 segments and L breaks for a body with L attention calls (1 segment, 0 breaks if full)."""

    def __init__(self, new_segment: Callable[[], Segment]):
        self._new_segment = new_segment
        self.segments: list[Segment] = []
        self.breaks: list[Callable[[], None]] = []
        self.output: Any = None
        self._open = False

    def open(self) -> None:
        seg = self._new_segment()
        seg.begin()
        self.segments.append(seg)
        self._open = True

    def close(self) -> None:
        self._open = False
        self.segments[-1].end()

    def abort(self) -> None:
        """End an open segment after an error without hiding the original exception."""
        if self._open:
            with contextlib.suppress(Exception):
                self.close()

    def replay(self) -> Any:
        for i, seg in enumerate(self.segments):
            seg.replay()
            if i < len(self.breaks):
                self.breaks[i]()
        return self.output


class SegmentedBackend(GraphBackend):
    """Warm up, then capture a body as segments; replay = segments and breaks in capture order."""

    warmups = 1

    def __init__(self, max_rows: int, breakable: bool):
        super().__init__()
        self.breakable = breakable
        self.static_attention = not breakable
        self.bridges = Bridges(max_rows)
        self.outputs = OutputBuffers(max_rows)
        self._active: SegmentedGraph | None = None
        self._warming = False

    # subclass hooks
    def _new_segment(self) -> Segment:
        raise NotImplementedError

    def _capture_scope(self):
        """Context for warm-up and capture (the CUDA backends enter their side stream here)."""
        return contextlib.nullcontext()

    def _begin_graph(self) -> None:
        """Called just before the first segment opens (the tape backend arms its checks)."""

    # the interface
    def capture(self, key, body: Body) -> None:
        with self._capture_scope():
            for _ in range(self.warmups):
                self._warm_up(body)
            graph = SegmentedGraph(self._new_segment)
            self._begin_graph()
            self._active = graph
            try:
                graph.open()
                graph.output = self.outputs.store(body())
            except BaseException:
                graph.abort()
                raise
            finally:
                self._active = None
            graph.close()
        self._graphs[key] = graph

    def replay(self, key) -> Any:
        return self._graphs[key].replay()

    def attend(self, live: ForwardBatch, layer_id: int, q, k, v, scale) -> torch.Tensor:
        graph = self._active
        if graph is None or not self.breakable:
            out = live_attention(live, layer_id, q, k, v, scale)
            if self._warming and self.breakable:
                self.bridges.ensure(q, k, v, out)
            return out
        bq, bk, bv, bo = self.bridges.views(q, k, v)
        # recorded in the open segment: the segment's q/k/v land in bridges it always writes
        bq.copy_(q)
        bk.copy_(k)
        bv.copy_(v)
        graph.close()

        def run() -> None:
            # NOTE: eager on purpose: reads the *live* metadata at call time, any batch shape fits.
            bo.copy_(live_attention(live, layer_id, bq, bk, bv, scale))
        run()
        graph.breaks.append(run)
        graph.open()
        return bo

    def persistent_tensors(self) -> list[torch.Tensor]:
        return self.bridges.tensors() + self.outputs.tensors()

    def _warm_up(self, body: Body) -> None:
        self._warming = True
        try:
            self.outputs.ensure(body())
        finally:
            self._warming = False
