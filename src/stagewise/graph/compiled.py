"""`compiled` backend: per-bucket `torch.compile` of the stage body at static shapes, fed from the
same static buffers as the graph backends. Attention stays outside the compiled graphs (a dynamo
graph break) so it reads the live metadata every step, like a breakable graph's attention.

Compiling costs seconds to tens of seconds per bucket; keep bucket lists short on CPU.
"""
from __future__ import annotations

import torch

from ..model.attention import ForwardBatch
from .backend import Body, GraphBackend, live_attention


@torch._dynamo.disable
def _eager_attention(live: ForwardBatch, layer_id: int, q, k, v, scale) -> torch.Tensor:
    # NOTE: a graph break on purpose: the metadata changes every step and must never be guarded on.
    return live_attention(live, layer_id, q, k, v, scale)


class CompiledBackend(GraphBackend):
    name = "compiled"

    def __init__(self, num_keys: int):
        super().__init__()
        # every key recompiles the same body code at new shapes; allow all of them (+ graph-break pieces)
        self._limit = max(8, 4 * num_keys)

    def _config(self):
        return torch._dynamo.config.patch(recompile_limit=self._limit, accumulated_recompile_limit=16 * self._limit)

    def capture(self, key, body: Body) -> None:
        fn = torch.compile(body, dynamic=False)
        with self._config():
            fn()      # compile at this bucket's static shapes
            fn()      # and check the guards hold on a second call (no recompile at replay)
        self._graphs[key] = fn

    def replay(self, key):
        with self._config():
            return self._graphs[key]()

    def attend(self, live, layer_id, q, k, v, scale):
        return _eager_attention(live, layer_id, q, k, v, scale)
