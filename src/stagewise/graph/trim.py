"""Trim a replayed output from its bucket's B rows to the step's T live rows (SPEC 7).

Returned rows are views of graph memory that the next replay overwrites: the caller sends
or copies them before the next forward on the stage.
"""
from __future__ import annotations

from typing import Any

import torch

from ..parallel.proxy import ProxyTensors


def trim_output(out: Any, num_tokens: int) -> Any:
    """ProxyTensors and tensors -> row views `[:T]`; tuples/lists leaf by leaf, container type kept."""
    if isinstance(out, ProxyTensors):
        return out[:num_tokens]
    if isinstance(out, torch.Tensor):
        return out[:num_tokens]
    if isinstance(out, (tuple, list)):
        leaves = [trim_output(x, num_tokens) for x in out]
        if hasattr(out, "_fields"):        # namedtuple: positional constructor
            return type(out)(*leaves)
        return type(out)(leaves)
    raise TypeError(f"Cannot trim a stage output of type {type(out).__name__} to the live rows; a stage forward "
                    "must return a tensor, ProxyTensors, or a tuple/list of those.")
