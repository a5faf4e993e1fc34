"""Build one stage: device, model, graph policy and runners, memory plan and KV cache.

Kept apart from the worker so `stagewise plan` can size stages without running them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint import load_hf_config, max_model_len
from ..config import EngineConfig
from ..graph.policy import policy_for
from ..model.attention import ForwardBatch
from ..model.loader import load_model, resolve_dtype
from ..parallel.partition import StageInfo
from . import cpu_pool
from .allocator import keep_freed_memory
from .kv_cache import allocate_kv_caches, kv_bytes_per_block
from .memory import MemoryPlan, estimate_activation_bytes, plan_kv
from .threads import configure_threads, intra_op_threads  # noqa: F401  (intra_op_threads: re-exported)

log = logging.getLogger("stagewise.runtime")


@dataclass
class StageParts:
    model: torch.nn.Module
    runner: Any
    memory_plan: MemoryPlan
    device: torch.device
    batch: ForwardBatch
    cpu_pool: Any = None          # CPU: the pinned, kept-awake thread team (cpu_pool.CpuPool), if any


def stage_device(config: EngineConfig, stage: StageInfo) -> torch.device:
    if config.resolved_device == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("--device cuda was given but no CUDA device is visible to this process; "
                             "use --device cpu (or --device auto).")
        local = int(os.environ.get("LOCAL_RANK", stage.rank % count))
        torch.cuda.set_device(local % count)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_stage(config: EngineConfig, model_dir: str, stage: StageInfo) -> StageParts:
    from ..graph.runner import StageGraphRunner
    device = stage_device(config, stage)
    pool = None
    if device.type == "cpu":
        pool = cpu_pool.for_stage(config, stage.rank, configure_threads(config))
        keep_freed_memory()
    hf_config = load_hf_config(model_dir)
    dtype = resolve_dtype(config.dtype, hf_config, device.type)
    model = load_model(model_dir, stage, dtype, device)
    policy = policy_for(config, device.type)
    batch = ForwardBatch(None, [None] * stage.num_layers)
    runner = StageGraphRunner(model, stage, policy, batch, dtype, device,
                              max_seq_len=max_model_len(config, hf_config))
    num_kv_heads, head_dim = model.kv_cache_spec()  # type: ignore[operator]  # the model contract's method
    block_bytes = kv_bytes_per_block(stage, num_kv_heads, head_dim, config.block_size, dtype)
    plan = _plan(config, stage, model, runner, hf_config, dtype, device, block_bytes)
    batch.kv_caches = allocate_kv_caches(stage, plan.num_blocks, config.block_size, num_kv_heads,
                                         head_dim, dtype, device)
    runner.capture(background=config.compile_in_background)
    plan.graph_pool_bytes = runner.graph_pool_bytes()
    return StageParts(model, runner, plan, device, batch, pool)


def _plan(config, stage, model, runner, hf_config, dtype, device, block_bytes) -> MemoryPlan:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    itemsize = torch.empty((), dtype=dtype).element_size()
    hidden = model.hidden_size
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    activation = estimate_activation_bytes(config.chunked_prefill_size, hidden, intermediate,
                                           hf_config.vocab_size, config.max_num_seqs, itemsize)
    device_total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    on_device = max(1, -(-config.stages_per_node // max(torch.cuda.device_count(), 1))) if device_total else 1
    per_seq_blocks = -(-max_model_len(config, hf_config) // config.block_size)
    return plan_kv(stage.rank, (stage.start, stage.end), weights=weights, graph_buffers=runner.static_bytes(),
                   graph_pools=0, activation=activation, block_bytes=block_bytes,
                   explicit_kv=config.kv_cache_memory, device_total=device_total, stages_on_device=on_device,
                   cap_blocks=config.max_num_seqs * per_seq_blocks + 1)
