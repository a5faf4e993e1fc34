"""stagewise: a compact LLM inference engine built around pipeline parallelism with captured prefill graphs.

Importing the package loads nothing heavy and changes nothing in the process environment: the
public names load on first use, and the `stagewise` command (cli.py) and the engine set what
they need (OpenMP's wait default, Inductor's cache directory) when they start.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"LLM": "llm", "SamplingParams": "request", "EngineConfig": "config", "RequestOutput": "request",
            "register_model": "model.registry"}
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "register_model"]

if TYPE_CHECKING:
    from .config import EngineConfig
    from .llm import LLM
    from .model.registry import register_model
    from .request import RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
