"""Executors run step plans on the stages: in this process (one stage) or in stage processes."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A stage died, timed out or answered out of order; the engine cannot continue.
    `outputs` holds the final (errored) outputs of the requests it failed."""

    def __init__(self, message: str, outputs=()):
        super().__init__(message)
        self.outputs = list(outputs)


def make_executor(config, model_dir: str, eos_token_ids: tuple[int, ...]):
    if config.pp_size == 1:
        from .local import LocalExecutor
        return LocalExecutor(config, model_dir, eos_token_ids)
    from .multiproc import MultiprocExecutor
    return MultiprocExecutor(config, model_dir, eos_token_ids)
