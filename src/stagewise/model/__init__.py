"""Pure nn.Module model stages: layers, paged attention, families, registry, loader, demo model.

Exports resolve lazily so `import stagewise.model.attention` does not pull in transformers.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "loader", "resolve_dtype": "loader",
    "register_model": "registry", "get_model_class": "registry", "supported_architectures": "registry",
    "build_demo_model": "demo", "ensure_demo_model": "demo", "default_demo_dir": "demo",
    "ForwardBatch": "attention", "AttentionMetadata": "attention",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'stagewise.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stagewise.model.{_EXPORTS[name]}"), name)
