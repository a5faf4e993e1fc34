"""Tape emulator (a test tool): a CPU stand-in for CUDA graphs that catches frozen-Python bugs.

Pass it as `StageGraphRunner(..., emulator=TapeBackend)`.

While a segment is open a TorchDispatchMode logs every aten call; replay re-issues the logged
ops without running any segment Python, so a batch-derived branch or scalar stays frozen exactly
as on a GPU. Capture refuses host syncs, Python-data tensors, RNG, and reads of tensors that are
neither made inside the graph nor registered as persistent (a per-step tensor leaking in).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from stagewise.graph.segments import Segment, SegmentedBackend

aten = torch.ops.aten

_HOST_READS = {
    aten._local_scalar_dense: ".item()/bool()/int() or a branch on a tensor value",
    aten.item: ".item()/int()/float() (a host sync)",
    aten.is_nonzero: "bool() of a tensor",
    aten.equal: "torch.equal (a host-side bool)",
    aten.nonzero: "nonzero (data-dependent shape)",
    aten.masked_select: "masked_select (data-dependent shape)",
    aten._unique: "unique (data-dependent shape)",
    aten._unique2: "unique (data-dependent shape)",
    aten.unique_dim: "unique (data-dependent shape)",
    aten.unique_consecutive: "unique_consecutive (data-dependent shape)",
    aten.lift_fresh: "a tensor built from Python data (a host-to-device copy on a GPU)",
    aten.lift_fresh_copy: "a tensor built from Python data (a host-to-device copy on a GPU)",
}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_PATCHED = ("tolist", "numpy", "cpu", "__array__")


class CaptureError(RuntimeError):
    """Something in a captured segment would be wrong or illegal under a real CUDA graph."""


def _kind(func, args, kwargs, out) -> str:
    """mutate: re-run; view: skip (the result aliases an input, whose data stays current);
    compute: re-run and copy into the logged result.

    NOTE: aliasing is read off the actual result, not the schema: under inference mode composite
    ops such as reshape/to/contiguous reach the tape, and they copy or alias depending on input.
    """
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return "mutate"
    inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if results and all(_storage_key(t) in inputs for t in results):
        return "view"
    return "compute"


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Op:
    __slots__ = ("func", "args", "kwargs", "out", "kind")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        self.kind = _kind(func, args, kwargs, out)

    def replay(self) -> None:
        if self.kind == "view":
            return
        new = self.func(*self.args, **self.kwargs)
        if self.kind == "compute":
            for old, fresh in zip(tree_leaves(self.out), tree_leaves(new)):
                if isinstance(old, torch.Tensor):
                    old.copy_(fresh)


class Provenance:
    """Storages a graph may read: persistent ones (weights, KV, static buffers) and its own results."""

    def __init__(self, persistent: list[torch.Tensor]):
        self.known = {_storage_key(t) for t in persistent if t.numel()}

    def check(self, func, args, kwargs) -> None:
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel() and _storage_key(t) not in self.known:
                raise CaptureError(
                    f"A captured segment's {func} reads a tensor of shape {tuple(t.shape)} that is neither made "
                    "inside the graph nor a registered persistent tensor (weights, KV cache, static buffers): a "
                    "replay would read its capture-time contents. Copy per-step data into a static buffer.")

    def add(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.known.add(_storage_key(t))


class _TapeMode(TorchDispatchMode):
    def __init__(self, segment: "TapeSegment"):
        super().__init__()
        self.segment = segment

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse(func, args)
        prov = self.segment.provenance
        if prov is not None:
            prov.check(func, args, kwargs)
        out = func(*args, **kwargs)
        if prov is not None:
            prov.add(out)
        self.segment.ops.append(_Op(func, args, kwargs, out))
        return out


def _refuse(func, args) -> None:
    packet = func.overloadpacket
    if packet in _HOST_READS:
        raise CaptureError(f"{func} inside a captured segment: {_HOST_READS[packet]} cannot be captured "
                           "(host sync or frozen value). Keep it out of the graph body.")
    if torch.Tag.nondeterministic_seeded in func.tags:
        raise CaptureError(f"{func} inside a captured segment: random ops must stay outside graphs.")
    if packet in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else ()
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            raise CaptureError(f"{func} with a boolean mask inside a captured segment has a data-dependent "
                               "shape; use torch.where or index with integer tensors.")


def _host_read(name: str) -> Callable:
    def refuse(self, *args, **kwargs):
        raise CaptureError(f"Tensor.{name}() inside a captured segment copies to the host; keep it out of "
                           "the graph body.")
    return refuse


class TapeSegment(Segment):
    def __init__(self, provenance: Provenance | None):
        self.provenance = provenance
        self.ops: list[_Op] = []
        self._mode: _TapeMode | None = None
        self._saved: dict[str, Any] = {}

    def begin(self) -> None:
        # NOTE: host reads on CPU tensors never dispatch, so they are refused by patching Tensor
        # methods while the segment is open (single-threaded capture; restored in end()).
        for name in _PATCHED:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, _host_read(name))
        self._mode = _TapeMode(self)
        self._mode.__enter__()

    def end(self) -> None:
        try:
            self._mode.__exit__(None, None, None)
        finally:
            for name, fn in self._saved.items():
                setattr(torch.Tensor, name, fn)
            self._saved.clear()

    def replay(self) -> None:
        for op in self.ops:
            op.replay()

    def nbytes(self) -> int:
        seen: dict[int, int] = {}
        for op in self.ops:
            for t in tree_leaves(op.out):
                if isinstance(t, torch.Tensor) and op.kind == "compute":
                    seen[_storage_key(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())


class TapeBackend(SegmentedBackend):
    """CPU emulation of `breakable` (breaks at attention) or `full` (one tape, static attention).

    NOTE: the tape keeps every intermediate of every bucket alive (no pool reuse): a test tool
    for small models, not a way to serve big buckets on CPU (use the rerun emulator for that).
    """

    name = "tape"

    def __init__(self, max_rows: int, breakable: bool, persistent: Callable[[], list[torch.Tensor]],
                 check_provenance: bool = True):
        super().__init__(max_rows, breakable)
        self._persistent = persistent
        self._check = check_provenance
        self._provenance: Provenance | None = None

    def _begin_graph(self) -> None:
        if self._check:
            self._provenance = Provenance(self._persistent() + self.persistent_tensors())

    def _new_segment(self) -> TapeSegment:
        return TapeSegment(self._provenance)

    def replay(self, key):
        with torch.inference_mode():     # the runner captures under inference mode: replay under the same
            return super().replay(key)

    def pool_bytes(self) -> int:
        return sum(seg.nbytes() for g in self._graphs.values() for seg in g.segments)
