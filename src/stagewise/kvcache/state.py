"""Recurrent-state slots for one stage: a model's linear-attention layers (model/qwen3_5.py) keep a
fixed-size state per running request instead of KV blocks. The pool holds, per such layer, one
tensor `[slots, ...]` per state part; a request takes a slot when the stage first sees it and gives
it back when the driver forgets it (finished, aborted or preempted: a preempted request restarts
its prefill, and a step that starts a sequence at position 0 starts it from a zero state).

The pool is sized for `max_num_seqs` requests (`slot_bytes` each, counted in the stage's memory
plan) and grows by copying where in-flight plans briefly hold more (a finished request is forgotten
only once its last plan is back).
"""
from __future__ import annotations

import torch

Spec = dict[int, list[tuple[tuple[int, ...], torch.dtype]]]


def slot_bytes(spec: Spec) -> int:
    """One request's state over the stage's recurrent layers."""
    total = 0
    for parts in spec.values():
        for shape, dtype in parts:
            n = 1
            for s in shape:
                n *= s
            total += n * dtype.itemsize
    return total


class StatePool:
    def __init__(self, spec: Spec, num_layers: int, num_slots: int, device: torch.device | str = "cpu"):
        self.spec, self.device = spec, torch.device(device)
        self.num_slots = max(1, num_slots)
        # per global layer id: a recurrent layer's state tensors, else None (ForwardBatch.states)
        self.layers: list[list[torch.Tensor] | None] = [None] * num_layers
        for layer_id, parts in spec.items():
            self.layers[layer_id] = [torch.zeros(self.num_slots, *shape, dtype=dtype, device=self.device)
                                     for shape, dtype in parts]
        self.free = list(range(self.num_slots - 1, -1, -1))     # popped from the end: slot 0 first

    def allocate(self) -> int:
        """A slot for a request (zeroed by the first step that starts its sequence)."""
        if not self.free:
            self._grow(self.num_slots)
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def _grow(self, extra: int) -> None:
        for parts in self.layers:
            if parts is not None:
                for i, t in enumerate(parts):
                    parts[i] = torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
        self.free.extend(range(self.num_slots + extra - 1, self.num_slots - 1, -1))
        self.num_slots += extra
