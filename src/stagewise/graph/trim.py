"""Trim a replayed output from its bucket's B rows to the step's T live rows, and the
small tree helpers graph backends use on stage outputs (tensor, ProxyTensors, tuple/list).

Returned rows are views of graph memory that the next replay overwrites: the caller sends
or copies them before the next forward on the stage.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..parallel.proxy import ProxyTensors


def map_output(fn: Callable[[torch.Tensor], Any], out: Any) -> Any:
    """Apply `fn` to every tensor of a stage output, keeping its structure and container types."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, ProxyTensors):
        return ProxyTensors({k: fn(t) for k, t in out.items()})
    if isinstance(out, (tuple, list)):
        leaves = [map_output(fn, x) for x in out]
        if hasattr(out, "_fields"):        # namedtuple: positional constructor
            return type(out)(*leaves)
        return type(out)(leaves)
    raise TypeError(f"Cannot trim a stage output of type {type(out).__name__} to the live rows; a stage forward "
                    "must return a tensor, ProxyTensors, or a tuple/list of those.")


def output_leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a stage output in `map_output` order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, ProxyTensors):
        return list(out.tensors.values())
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in output_leaves(x)]
    map_output(lambda t: t, out)   # raises the TypeError naming the type
    return []


def trim_output(out: Any, num_tokens: int) -> Any:
    """ProxyTensors and tensors -> row views `[:T]`; tuples/lists leaf by leaf, container type kept;
    any other type is a TypeError naming it."""
    if isinstance(out, ProxyTensors):
        return out[:num_tokens]
    return map_output(lambda t: t[:num_tokens], out)
