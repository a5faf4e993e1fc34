"""What a server is started with beyond the engine config: the served model name, the API key,
the request size limit and the graceful-shutdown timeout. Imports nothing heavy, so the CLI
can build its parser from it."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_REQUEST_BYTES = 2 << 20     # a 128K-token prompt fits twice as token ids, four times as text
DEFAULT_GRACEFUL_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 20.0
API_KEY_ENV = "STAGEWISE_API_KEY"
_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}


@dataclass(frozen=True)
class ServerOptions:
    served_model_name: str | None = None          # None: the checkpoint's base name
    api_key: str | None = None                    # None: no authentication
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    graceful_timeout_s: float = DEFAULT_GRACEFUL_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __post_init__(self):
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024 (1KiB), got {self.max_request_bytes}.")
        if not self.graceful_timeout_s >= 0:
            raise ValueError(f"graceful_timeout must be a number of seconds >= 0, got {self.graceful_timeout_s}.")
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout must be a number of seconds > 0, got {self.body_timeout_s}.")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a non-empty key or leave it out.")


def served_name_for(model_path: str | None) -> str:
    """The name clients see: the checkpoint directory's (or GGUF file's) base name, never its path."""
    name = Path(str(model_path or "").rstrip("/\\")).name
    return name or "stagewise"


def parse_size(text: str) -> int:
    """'4MiB', '512KiB', '1GB' or plain bytes ('4194304') -> bytes (argparse `type=`)."""
    value = str(text).strip().lower().replace(" ", "")
    for suffix, scale in _UNITS.items():
        if value.endswith(suffix) and value[: -len(suffix)]:
            number = value[: -len(suffix)]
            break
    else:
        number, scale = value, 1
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write bytes or a unit, e.g. 4MiB or 512KiB.") from None


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None
