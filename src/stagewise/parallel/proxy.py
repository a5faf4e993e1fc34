"""ProxyTensors: the named, token-major activations that cross a stage boundary.

Llama-family models send `hidden_states` + `residual` (the full contract); GPT-2-family
models send `hidden_states` only (the hidden-only contract). Row slicing returns views.
"""
from __future__ import annotations

from typing import Iterator

import torch

FULL_CONTRACT = ("hidden_states", "residual")
HIDDEN_ONLY_CONTRACT = ("hidden_states",)


class ProxyTensors:
    """An ordered mapping name -> tensor whose axis 0 is the token axis."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        if not tensors:
            raise ValueError("ProxyTensors needs at least one tensor.")
        rows = {t.shape[0] for t in tensors.values()}
        if len(rows) != 1:
            raise ValueError(f"ProxyTensors rows disagree: { {k: tuple(t.shape) for k, t in tensors.items()} }.")
        self.tensors = dict(tensors)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.tensors[key]
        if isinstance(key, slice):
            return ProxyTensors({k: t[key] for k, t in self.tensors.items()})
        raise TypeError(f"ProxyTensors index must be a key or a row slice, not {type(key).__name__}.")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    @property
    def num_rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def clone(self) -> "ProxyTensors":
        return ProxyTensors({k: t.clone() for k, t in self.tensors.items()})

    def __repr__(self) -> str:
        return "ProxyTensors(" + ", ".join(f"{k}={tuple(t.shape)}" for k, t in self.items()) + ")"
