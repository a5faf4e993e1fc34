"""Every error class a user of stagewise can catch, in one place.

Each message is one sentence saying what was wrong and what to do; the server turns
`ValueError`s into HTTP 400 and `EngineDeadError` into 503.
"""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A stage died, timed out or answered out of order; the engine cannot continue.
    `outputs` holds the final (errored) outputs of the requests it failed."""

    def __init__(self, message: str, outputs=()):
        super().__init__(message)
        self.outputs = list(outputs)


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context or the KV cache."""


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """A checkpoint directory or one of its files is missing (catchable as either base)."""
