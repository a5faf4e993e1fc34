"""Shared-memory collectives of one node's tensor-parallel group (csrc/comm.c): bindings,
argument checks and the ops `stagewise::all_reduce` / `stagewise::all_gather`.

A group is a file (under /dev/shm where there is one) that every rank maps: `create` makes it
before the ranks start, `ShmGroup(path, rank, size, timeout_s)` is one rank's view. The
all-reduce sums in rank order, so every rank gets the same bits; the ops are opaque to
`torch.compile`, so a compiled stage body keeps its collectives inside the graph.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import build, native
from .registry import define

F32, BF16 = 0, 1
_DTYPES = {torch.float32: F32, torch.bfloat16: BF16}
_TIMEOUT, _ABORTED, _BAD_HANDLE, _BAD_ARGS = 1, 2, -1, -2


class CollectiveError(RuntimeError):
    """A collective could not finish: a peer timed out, failed, or the group was aborted. The
    group is unusable afterwards; the stage must stop (its pipeline is rebuilt)."""


@functools.cache
def _load() -> ctypes.CDLL | None:
    lib = build.library("comm", ["comm.c"])
    if lib is None:
        return None
    i64, p, s = ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p
    signatures = {"comm_file_bytes": [i64, i64], "comm_create": [s, i64, i64], "comm_attach": [s, i64, i64, i64],
                  "comm_attached": [i64], "comm_rank": [i64], "comm_size": [i64],
                  "comm_all_reduce": [i64, p, p, i64, i64], "comm_all_gather": [i64, p, p, i64, i64, i64]}
    for name, args in signatures.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, i64
    for name in ("comm_detach", "comm_abort"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [i64], None
    native.load("comm", lib)
    return lib


def available() -> bool:
    return _load() is not None


def _lib() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError("The shared-memory collectives kernel is not available on this machine.")
    return lib


def shm_dir() -> str:
    """Where group files go: /dev/shm (memory, never written back) where it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else os.environ.get(
        "TMPDIR", "/tmp")


def create(path: str, size: int, slot_bytes: int) -> None:
    """Make the group file of `size` ranks with `slot_bytes` (a multiple of 64) per rank and buffer."""
    rc = _lib().comm_create(path.encode(), size, slot_bytes)
    if rc:
        raise OSError(-rc if rc < 0 and rc != _BAD_ARGS else 22,
                      f"cannot create the tensor-parallel group file {path} ({size} ranks, {slot_bytes} bytes a slot)")


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} {x.device.type} {list(x.shape)}"


def _raise(rc: int, op: str, group: int) -> None:
    lib = _lib()
    rank, size = lib.comm_rank(group), lib.comm_size(group)
    if rc == _TIMEOUT:
        raise CollectiveError(f"tensor-parallel {op}: rank {rank} of {size} waited longer than its timeout for the "
                              f"other ranks of its stage; one of them died or is stuck.")
    if rc == _ABORTED:
        raise CollectiveError(f"tensor-parallel {op}: rank {rank} of {size} stopped because another rank of its "
                              f"stage gave up (it timed out or failed).")
    if rc == _BAD_HANDLE:
        raise ValueError(f"tensor-parallel {op}: group {group} is not open in this process.")
    raise ValueError(f"tensor-parallel {op}: the kernel refused its arguments (group {group}).")


def _check_reduce(x: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        raise ValueError(f"stagewise all_reduce: it needs a CPU float32 or bfloat16 tensor, got {_describe(x)}.")


def _all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    _check_reduce(x)
    x = x.contiguous()
    out = torch.empty_like(x)
    rc = _lib().comm_all_reduce(group, x.data_ptr(), out.data_ptr(), x.numel(), _DTYPES[x.dtype])
    if rc:
        _raise(rc, "all-reduce", group)
    return out


def _check_gather(x: torch.Tensor, group: int, size: int, dst: int) -> None:
    actual = _lib().comm_size(group)
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"stagewise all_gather: it needs a CPU float tensor [rows, columns], got {_describe(x)}.")
    if actual != size or not -1 <= dst < size:
        raise ValueError(f"stagewise all_gather: group {group} has {actual} ranks; the call said {size} ranks and "
                         f"destination {dst} (-1: every rank).")


def _all_gather(x: torch.Tensor, group: int, size: int, dst: int) -> torch.Tensor:
    _check_gather(x, group, size, dst)
    x = x.contiguous()
    rows, cols = x.shape
    out = x.new_empty(rows, size * cols)
    rc = _lib().comm_all_gather(group, x.data_ptr(), out.data_ptr(), rows, cols * x.element_size(), dst)
    if rc:
        _raise(rc, "all-gather", group)
    return out


define("all_reduce(Tensor x, int group) -> Tensor", _all_reduce, lambda x, group: torch.empty_like(x))
define("all_gather(Tensor x, int group, int size, int dst) -> Tensor", _all_gather,
       lambda x, group, size, dst: x.new_empty(x.shape[0], size * x.shape[1]))


def _traced() -> bool:
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


@contextlib.contextmanager
def _collective_errors() -> Iterator[None]:
    """The C++ op's failures arrive as RuntimeError: a peer that timed out or gave up is a CollectiveError."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        if "tensor-parallel" not in str(exc):
            raise
        raise CollectiveError(str(exc).splitlines()[0]) from None


class ShmGroup:
    """One rank's view of a group file: sum and gather across the ranks of one node's stage.

    `timeout_s` bounds every wait for the other ranks; past it (or once any rank gave up) every
    call raises `CollectiveError`."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float):
        self.path, self.rank, self.size = path, rank, size
        self.handle = _lib().comm_attach(path.encode(), rank, size, max(1, int(timeout_s * 1000)))
        if self.handle < 0:
            raise OSError(f"cannot open the tensor-parallel group file {path} as rank {rank} of {size} (code "
                          f"{self.handle}); the stage's processes must run on one machine.")

    def attached(self) -> int:
        """Ranks that have opened the file so far."""
        return int(_lib().comm_attached(self.handle))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (a new tensor, the same bits on every rank)."""
        if _traced():
            return torch.ops.stagewise.all_reduce(x, self.handle)
        with _collective_errors():
            return torch.ops.stagewise.all_reduce(x, self.handle) if native.loaded("comm") else _all_reduce(
                x, self.handle)

    def all_gather(self, x: torch.Tensor, dst: int = -1) -> torch.Tensor:
        """`[R, C]` per rank -> `[R, size * C]`, rank r's columns at `r * C`; only rank `dst`
        receives them (-1: every rank; elsewhere the result is uninitialised)."""
        if _traced():
            return torch.ops.stagewise.all_gather(x, self.handle, self.size, dst)
        with _collective_errors():
            return torch.ops.stagewise.all_gather(x, self.handle, self.size, dst) if native.loaded("comm") \
                else _all_gather(x, self.handle, self.size, dst)

    def abort(self) -> None:
        """Make every rank's waits end with CollectiveError (this rank cannot go on)."""
        _lib().comm_abort(self.handle)

    def close(self) -> None:
        if self.handle >= 0:
            _lib().comm_detach(self.handle)
            self.handle = -1
