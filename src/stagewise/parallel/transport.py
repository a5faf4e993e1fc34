"""Point-to-point messages between pipeline ranks over torch.distributed.

A message is an int64 header length, a pickled header (kind, payload object, tensor
metadata), then each non-empty tensor in header order. Every send is an isend whose
(work, tensor) pairs are kept until `wait()` returns (gloo may hold a send until the
peer posts its receive). Receives take a deadline; a dead peer surfaces as an error.
"""
from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Message:
    kind: str                                   # "plan", "proxy", "result", "ready", "error", "heartbeat", "shutdown"
    obj: Any = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class PendingSend:
    """Handles of one isent message; the tensors stay referenced until `wait()`."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works, self.tensors = works, tensors

    def wait(self, timeout_s: float | None = None) -> None:
        for w in self.works:
            w.wait(timedelta(seconds=timeout_s)) if timeout_s else w.wait()
        self.works, self.tensors = [], []


def send_message(msg: Message, dst: int, group=None) -> PendingSend:
    # NOTE: host staging: gloo moves CPU tensors, and it also works for two stages sharing one GPU
    # (which NCCL refuses).
    tensors = {k: t.detach().cpu().contiguous() for k, t in msg.tensors.items()}
    meta = [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    header = torch.frombuffer(bytearray(pickle.dumps((msg.kind, msg.obj, meta))), dtype=torch.uint8)
    size = torch.tensor([header.numel()], dtype=torch.int64)
    keep = [size, header] + [t for t in tensors.values() if t.numel()]
    works = [dist.isend(t, dst, group=group) for t in keep]
    return PendingSend(works, keep)


def recv_message(src: int, timeout_s: float, group=None, poll_s: float | None = None) -> Message:
    """`poll_s`: wait for the message's start in Python steps of that length (signals are handled
    between them) instead of blocking in C++; for long waits such as start-up."""
    deadline = timedelta(seconds=timeout_s)
    size = torch.empty(1, dtype=torch.int64)
    work = _irecv(size, src, group)
    if poll_s:
        _wait_interruptibly(work, deadline, poll_s)
    else:
        work.wait(deadline)
    header = torch.empty(int(size[0]), dtype=torch.uint8)
    _irecv(header, src, group).wait(deadline)
    kind, obj, meta = pickle.loads(header.numpy().tobytes())
    tensors = {}
    for key, shape, dtype in meta:
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            _irecv(t, src, group).wait(deadline)
        tensors[key] = t
    return Message(kind, obj, tensors)


def _irecv(t: torch.Tensor, src: int, group) -> dist.Work:
    work = dist.irecv(t, src, group=group)
    assert work is not None, "irecv from outside the group"   # every stage is in the group
    return work


def _wait_interruptibly(work, deadline: timedelta, poll_s: float) -> None:
    """`work.wait` in a helper thread while this thread wakes every `poll_s` to run signal handlers.

    NOTE: gloo's `is_completed()` stays False until someone waits, so polling it cannot work. If a
    signal unwinds this thread, the helper stays blocked until the links close."""
    done, failed = threading.Event(), []

    def wait() -> None:
        try:
            work.wait(deadline)
        except Exception as exc:   # noqa: BLE001  (re-raised in the caller's thread)
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True, name="stagewise-recv").start()
    while not done.wait(poll_s):
        pass
    if failed:
        raise failed[0]
