"""Executors run step plans on the stages: in this process (one stage) or in stage processes."""
from __future__ import annotations


def make_executor(config, model_dir: str, eos_token_ids: tuple[int, ...]):
    if config.pp_size == 1:
        from .local import LocalExecutor
        return LocalExecutor(config, model_dir, eos_token_ids)
    from .multiproc import MultiprocExecutor
    return MultiprocExecutor(config, model_dir, eos_token_ids)
