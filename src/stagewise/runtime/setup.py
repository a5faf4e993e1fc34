"""Build one stage: device, model, graph policy and runners, memory plan and KV cache.

Kept apart from the worker so `stagewise plan` can size stages without running them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..checkpoint.facts import read_facts
from ..checkpoint.lora_files import parse_lora_modules
from ..config import EngineConfig
from ..graph.policy import policy_for
from ..kvcache.state import StatePool, slot_bytes
from ..kvcache.tensors import allocate_kv_caches
from ..model import attention as model_attention
from ..model.attention import ForwardBatch
from ..model.loader import exact_mode, load_model, resolve_dtype
from ..model.lora import attach_loras
from ..model.quantized import weight_bytes
from ..parallel import tp as tensor_parallel
from ..parallel.partition import StageInfo
from ..planning.memory import (
    MemoryPlan,
    in_process,
    kv_bytes_per_block,
    measured_node_bytes,
    process_bytes,
    size_text,
    stage_budget_bytes,
    stage_plan,
)
from . import cpu_pool
from .allocator import keep_freed_memory, release_load_temporaries, return_freed_memory
from .team import decode_threads
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
    states: StatePool | None = None   # recurrent-state slots (linear-attention layers), if the model has any


def stage_device(config: EngineConfig, stage: StageInfo) -> torch.device:
    if config.load.resolved_device == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("--device cuda was given but no CUDA device is visible to this process; "
                             "use --device cpu (or --device auto).")
        local = int(os.environ.get("LOCAL_RANK", stage.rank % count))
        torch.cuda.set_device(local % count)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_stage(config: EngineConfig, model_dir: str, stage: StageInfo, tp_group: Any = None) -> StageParts:
    """The stage's parts; with `tp_group`, its rank's shard of the model, joined by the group's collectives."""
    from ..graph.runner import StageGraphRunner
    device = stage_device(config, stage)
    pool = None
    if device.type == "cpu":
        pool = cpu_pool.for_stage(config, stage.rank, configure_threads(config), tp_group.rank if tp_group else 0)
        return_freed_memory()
    facts = read_facts(model_dir)
    hf_config = facts.hf
    dtype = resolve_dtype(config.load.dtype, hf_config, device.type)
    node_bytes = config.cache.node_memory_bytes
    if device.type == "cpu" and node_bytes is None:   # torchrun: no driver measured it
        node_bytes = measured_node_bytes()
    model = load_model(model_dir, stage, dtype, device, tp=(tp_group.rank, tp_group.size) if tp_group else None,
                       quantization=config.load.quantization, exact=exact_mode(config.load.dtype, hf_config))
    # LoRA adapters: this stage's layers' A/B, hooked onto their projections (read before the KV plan)
    attach_loras(model, stage, parse_lora_modules(config.load.lora_modules), config.load.max_lora_rank,
                 (facts.heads, facts.kv_heads), runtime=config.load.enable_lora_runtime_updates)
    if device.type == "cpu":    # loading's temporaries go back to the kernel; the steps' are kept from here on
        release_load_temporaries()
        keep_freed_memory()
    if tp_group is not None:
        # NOTE: every rank gathers the logits, so every rank's sampler draws the same tokens
        tensor_parallel.connect(model, tp_group, logits_to=-1)
    policy = policy_for(config, device.type)
    model_attention.INVARIANT = config.scheduler.invariant_attention   # process-wide: one engine's stages per process
    batch = ForwardBatch(None, [None] * stage.num_layers)
    runner = StageGraphRunner(model, stage, policy, batch, dtype, device,
                              max_seq_len=facts.max_len(config.scheduler.max_model_len))
    num_kv_heads, head_dim = model.kv_cache_spec()  # type: ignore[operator]  # the model contract's method
    block_bytes = kv_bytes_per_block(stage, num_kv_heads, head_dim, config.cache.block_size, dtype,
                                     config.cache.kv_cache_dtype, hf_config)
    plan = _plan(config, stage, model, runner, facts, dtype, device, block_bytes, node_bytes)
    if tp_group is not None:
        plan = _agreed(plan, tp_group)
    kv_layers = getattr(model, "kv_layer_ids", None)       # hybrid models: only their attention layers
    batch.kv_caches = allocate_kv_caches(stage, plan.num_blocks, config.cache.block_size, num_kv_heads,
                                         head_dim, dtype, device, config.cache.kv_cache_dtype,
                                         layers=kv_layers() if kv_layers is not None else None)
    states = _state_pool(config, model, stage, device, plan)
    batch.states = states.layers if states is not None else None
    if device.type == "cpu":                # decode steps' team; their graph is compiled for it
        runner.decode_threads = decode_threads(model, plan.weights_bytes, torch.get_num_threads())
    runner.capture(background=config.graphs.compile_in_background)
    plan.graph_pool_bytes = runner.graph_pool_bytes()
    return StageParts(model, runner, plan, device, batch, pool, states)


def _state_pool(config: EngineConfig, model, stage: StageInfo, device, plan: MemoryPlan) -> StatePool | None:
    """The recurrent-state slots of a model with linear-attention layers on this stage (None: none)."""
    spec: dict = getattr(model, "state_spec", dict)()
    if not spec:
        return None
    pool = StatePool(spec, stage.num_layers, config.scheduler.max_num_seqs, device)
    log.info("stage %d: recurrent state of %d layers, %s per request, %d slots (%s, in the memory plan)",
             stage.rank, len(spec), size_text(slot_bytes(spec)), pool.num_slots, size_text(plan.state_bytes))
    return pool


def _agreed(plan: MemoryPlan, group: Any) -> MemoryPlan:
    """The plan with the KV blocks every rank of the stage can hold (the fewest): ranks may hold
    different KV heads and weights (uneven head splits), but they share the driver's block tables."""
    mine = torch.tensor([[plan.num_blocks >> 12, plan.num_blocks & 4095]], dtype=torch.float32)   # exact in f32
    pairs = group.all_gather(mine).view(-1, 2).long()
    blocks = int((pairs[:, 0] * 4096 + pairs[:, 1]).min())
    return replace(plan, num_blocks=blocks, kv_bytes=blocks * plan.block_bytes)


def _plan(config, stage, model, runner, facts, dtype, device, block_bytes, node_bytes) -> MemoryPlan:
    if device.type == "cuda":
        budget = stage_budget_bytes(node_bytes=None, stages_on_node=1,
                                    device_total=torch.cuda.get_device_properties(device).total_memory,
                                    stages_on_device=max(1, -(-config.stages_per_node // torch.cuda.device_count())))
    else:
        budget = stage_budget_bytes(node_bytes=node_bytes, stages_on_node=config.ranks_per_node)
    return stage_plan(config, facts, stage, torch.empty((), dtype=dtype).element_size(), weights=weight_bytes(model),
                      graph_buffers=runner.static_bytes(), block_bytes=block_bytes, budget=budget,
                      process=process_bytes(in_process(config)) if device.type == "cpu" else 0)
