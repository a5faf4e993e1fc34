"""Every error class a user of stagewise can catch, in one place, and `describe_exit` for the
messages that report a process that ended.

Each message is one sentence saying what was wrong and what to do; the server turns
`ValueError`s into HTTP 400 and `EngineDeadError` into 503.
"""
from __future__ import annotations

import signal


class EngineDeadError(RuntimeError):
    """A stage died, timed out or answered out of order; the engine cannot continue.
    `outputs` holds the final (errored) outputs of the requests it failed."""

    def __init__(self, message: str, outputs=()):
        super().__init__(message)
        self.outputs = list(outputs)


class ClusterAuthError(ValueError):
    """A pipeline connection without the cluster token (or to a peer without it) was refused."""


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context or the KV cache."""


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """A checkpoint directory or one of its files is missing (catchable as either base)."""


class LoraNotFoundError(LookupError, ValueError):
    """A runtime LoRA unload named an adapter the engine does not hold (HTTP 404)."""


class LoraInUseError(ValueError):
    """A runtime LoRA unload named an adapter that unfinished requests still run on (HTTP 409)."""


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, for people: 'was killed by SIGKILL (exit code -9)', 'exited with code 1'."""
    if exitcode is None:
        return "ended (its exit code is not known yet)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"
