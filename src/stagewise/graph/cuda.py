"""Real CUDA graph backends: `cuda_breakable` (segments split at attention, attention eager between
them with live metadata) and `cuda_full` (one graph per bucket, static-shape attention inside).

Both share one memory pool and one side stream per stage (`CudaContext`), warm up twice before
each capture, and are captured largest bucket first so smaller buckets reuse the pool.
Not exercised on CPU machines; every CUDA call sits behind these classes.
"""
from __future__ import annotations

import contextlib

import torch

from .segments import Segment, SegmentedBackend


class CudaContext:
    """The side stream and graph pool every backend of one stage captures into."""

    def __init__(self, device: torch.device):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graph backends need a CUDA device; use an emulated policy on this machine.")
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream()
            self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def scope(self):
        """Make the stage's GPU current and run on the side stream, joined before and after.

        NOTE: capturing on the default stream is illegal, and another current device gives an empty
        graph and silently wrong results.
        """
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            self.stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(self.stream):
                    yield
            finally:
                torch.cuda.current_stream().wait_stream(self.stream)
                torch.cuda.synchronize()

    @staticmethod
    def memory() -> tuple[int, int]:
        """(free bytes on the device, bytes reserved by the caching allocator)."""
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()


class CudaSegment(Segment):
    def __init__(self, pool):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


class CudaSegmentedBackend(SegmentedBackend):
    """Shared by both CUDA backends; `breakable` decides where segments end."""

    warmups = 2   # absorbs lazy work: cuBLAS workspaces, Triton autotune, lazy caches

    def __init__(self, ctx: CudaContext, max_rows: int, breakable: bool):
        super().__init__(max_rows, breakable)
        self.ctx = ctx

    def _capture_scope(self):
        return self.ctx.scope()

    def _new_segment(self) -> CudaSegment:
        return CudaSegment(self.ctx.pool)

    def _warm_up(self, body) -> None:
        super()._warm_up(body)
        torch.cuda.synchronize()


class CudaBreakableBackend(CudaSegmentedBackend):
    name = "cuda_breakable"

    def __init__(self, ctx: CudaContext, max_rows: int):
        super().__init__(ctx, max_rows, breakable=True)


class CudaFullBackend(CudaSegmentedBackend):
    """One CUDA graph per key: the body's attention must be the static one (StaticForwardBatch)."""

    name = "cuda_full"

    def __init__(self, ctx: CudaContext, max_rows: int):
        super().__init__(ctx, max_rows, breakable=False)
