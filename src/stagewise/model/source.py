"""Which checkpoint a `--model` value names. Entry points call `resolve_model` once; everything
after it (engine, stages, `stagewise plan`) sees a local path.

`None` is the default model; "demo" is the built-in tiny random demo model (built once into
the cache directory).
"""
from __future__ import annotations

from pathlib import Path

DEMO_NAMES = ("demo",)


def resolve_model(model: str | Path | None) -> str:
    """A local checkpoint path for `model` (None: the default model)."""
    if model is None or str(model) in DEMO_NAMES:
        from .demo import ensure_demo_model
        return str(ensure_demo_model())
    return str(model)
