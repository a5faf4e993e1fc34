"""The `stagewise::` kernel ops: each is declared once, by `define` in its concern's module, with
its schema, its Python implementation (which checks its arguments before any kernel touches
memory) and its fake for torch.compile. Where csrc/<concern>_ops.cpp built (`native`), its CPU
kernels take precedence: the Python implementations are registered for CompositeExplicitAutograd,
which the dispatcher uses only for a backend with no kernel of its own.

NOTE: ops go through `torch.library.Library`, not `custom_op`: the dispatcher then calls the
implementation directly, without custom_op's per-call checks (~14 us instead of ~24 us a call).
"""
from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("stagewise", "FRAGMENT")


def define(schema: str, impl: Callable, fake: Callable) -> None:
    """Declare `stagewise::<schema>` with `impl` (in Python) and `fake` for tracing."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"stagewise::{name}", fake, lib=_LIB)
