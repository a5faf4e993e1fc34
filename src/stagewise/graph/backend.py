"""The graph-backend interface (can_replay / capture / replay), the batch a graph body sees,
persistent output and bridge buffers, and the simplest backend: the rerun emulator.

A backend never sees requests: the runner hands it a zero-argument `body` per key that runs the
stage on the static buffer views, and asks it to replay that key after filling the buffers.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

from ..model.attention import ForwardBatch
from .trim import map_output, output_leaves

Body = Callable[[], Any]


class GraphBatch(ForwardBatch):
    """The `batch` a live-attention graph body sees: `meta` and `kv_caches` read through to the
    runner's ForwardBatch; `attention` goes through the backend's hook (a break, a compile
    boundary, or a plain call) which reads the live metadata when it runs."""

    def __init__(self, live: ForwardBatch, attend: Callable[..., torch.Tensor] | None):
        # NOTE: no super().__init__: meta and kv_caches are properties of the live batch.
        self._live, self._attend = live, attend

    @property
    def meta(self):
        return self._live.meta

    @property
    def kv_caches(self):
        return self._live.kv_caches

    def kv_target(self, layer_id):
        return None       # graph bodies write the KV cache in their attention (traced or hooked)

    def attention(self, layer_id, q, k, v, scale):
        assert self._attend is not None, "a batch built without a hook overrides attention"
        return self._attend(self._live, layer_id, q, k, v, scale)


def live_attention(live: ForwardBatch, layer_id: int, q, k, v, scale) -> torch.Tensor:
    return live.attention(layer_id, q, k, v, scale)


class GraphBackend:
    """One way of capturing and replaying bodies, keyed by whatever the runner chooses."""

    name = "base"
    static_attention = False     # True: the body's attention reads static metadata (full graphs)

    def __init__(self) -> None:
        self._graphs: dict[Hashable, Any] = {}

    def can_replay(self, key: Hashable) -> bool:
        return key in self._graphs

    def capture(self, key: Hashable, body: Body) -> None:
        raise NotImplementedError

    def replay(self, key: Hashable) -> Any:
        """Run the captured body again; reads only static buffers. Returns its B-row output."""
        raise NotImplementedError

    def attend(self, live: ForwardBatch, layer_id: int, q, k, v, scale) -> torch.Tensor:
        return live_attention(live, layer_id, q, k, v, scale)

    def persistent_tensors(self) -> list[torch.Tensor]:
        """Buffers this backend owns that outlive every replay (bridges, outputs)."""
        return []

    def pool_bytes(self) -> int:
        return 0


class RerunBackend(GraphBackend):
    """Level-1 emulator (CPU stand-in for breakable/full): capture runs the body once, replay
    runs it again on the same static views. Blind to frozen Python; see TapeBackend for that.

    Attention is always the live one, for `full` too: this is the emulator engines run on CPU,
    and static attention costs rows x max_seq_len keys per layer. The tape emulator and the
    CUDA backend run the static attention.
    """

    name = "rerun"

    def capture(self, key, body):
        body()
        self._graphs[key] = body

    def replay(self, key):
        return self._graphs[key]()


def _signature(tensors: list[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape[1:]), t.dtype, t.device) for t in tensors)


class OutputBuffers:
    """Persistent `[max_rows, ...]` homes for body outputs, shared by every key (one replay's
    output is live at a time), so a captured graph does not pin its output in the pool."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._bufs: dict[tuple, list[torch.Tensor]] = {}

    def ensure(self, out: Any) -> None:
        leaves = output_leaves(out)
        sig = _signature(leaves)
        if sig not in self._bufs:
            self._bufs[sig] = [torch.empty(self.max_rows, *t.shape[1:], dtype=t.dtype, device=t.device)
                               for t in leaves]   # [M, ...] per leaf

    def store(self, out: Any) -> Any:
        """Copy each leaf into its buffer (inside the capture, so replays repeat it) and return
        the same structure made of buffer views."""
        leaves = output_leaves(out)
        bufs = iter(self._bufs[_signature(leaves)])

        def place(t: torch.Tensor) -> torch.Tensor:
            view = next(bufs)[:t.shape[0]]
            view.copy_(t)
            return view
        return map_output(place, out)

    def tensors(self) -> list[torch.Tensor]:
        return [t for bufs in self._bufs.values() for t in bufs]


class Bridges:
    """Persistent q/k/v/out buffers for attention breaks, one set per attention shape, shared by
    every layer and bucket: closures over them pin nothing in the graph pool."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._sets: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def ensure(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        sig = _signature([q, k, v])
        if sig not in self._sets:
            self._sets[sig] = tuple(torch.empty(self.max_rows, *t.shape[1:], dtype=t.dtype, device=t.device)
                                    for t in (q, k, v, out))   # [M, H*, D] each

    def views(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sig = _signature([q, k, v])
        if sig not in self._sets:
            raise RuntimeError(f"Attention with q {tuple(q.shape)}, k {tuple(k.shape)} was not seen during "
                               "warm-up; the body must call attention with the same shapes every run.")
        return tuple(t[:q.shape[0]] for t in self._sets[sig])

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in self._sets.values() for t in s]
