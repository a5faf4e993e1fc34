"""`stagewise plan`: each stage's layers, weight bytes and KV capacity, computed on the meta
device from config.json (or a GGUF file's metadata) alone — nothing is loaded or launched."""
from __future__ import annotations

from collections import Counter

import torch

from ..checkpoint import gguf_file_of, load_hf_config, max_model_len
from ..config import EngineConfig
from ..gguf_meta import gguf_facts
from ..model.loader import _architecture, resolve_dtype
from ..model.registry import get_model_class
from ..parallel.partition import stage_infos
from .kv_cache import kv_bytes_per_block
from .memory import estimate_activation_bytes, format_memory_table, plan_kv
from .stage_cost import partition_lines, resolve_partition


def plan_report(config: EngineConfig) -> str:
    model_dir = config.model
    assert model_dir is not None, "plan_report needs the resolved model path (cli.config_from_args)"
    hf = load_hf_config(model_dir)
    device = config.resolved_device
    dtype = resolve_dtype(config.dtype, hf, device)
    cls = get_model_class(_architecture(hf, model_dir))
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_seq_blocks = -(-max_model_len(config, hf) // config.block_size)
    plans = []
    for stage in stage_infos(hf.num_hidden_layers, config.pp_size, resolve_partition(config, hf)):
        with torch.device("meta"):
            model = cls(hf, stage, dtype)
        weights = sum(p.numel() for p in model.parameters()) * itemsize
        heads, head_dim = model.kv_cache_spec()
        block = kv_bytes_per_block(stage, heads, head_dim, config.block_size, dtype)
        act = estimate_activation_bytes(config.chunked_prefill_size, model.hidden_size,
                                        getattr(hf, "intermediate_size", None) or 4 * model.hidden_size,
                                        hf.vocab_size, config.max_num_seqs, itemsize)
        total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
        plans.append(plan_kv(stage.rank, (stage.start, stage.end), weights=weights, graph_buffers=0, graph_pools=0,
                             activation=act, block_bytes=block, explicit_kv=config.kv_cache_memory,
                             device_total=total, stages_on_device=1,
                             cap_blocks=config.max_num_seqs * per_seq_blocks + 1))
    tokens = min(p.num_blocks for p in plans) * config.block_size
    return (f"model {model_dir}: {hf.num_hidden_layers} layers, {config.pp_size} stage(s), {dtype}, {device}\n"
            f"{_gguf_line(model_dir, dtype)}{_partition_text(config, hf)}{format_memory_table(plans)}\n"
            f"KV capacity: {tokens} tokens ({tokens // max_model_len(config, hf)} full-length sequences)")


def _gguf_line(model_dir: str, dtype: torch.dtype) -> str:
    """For a GGUF file: its tensor types and size on disk; weights above are the dequantized bytes."""
    path = gguf_file_of(model_dir)
    if path is None:
        return ""
    types = Counter(gguf_facts(path).types.values())
    listed = ", ".join(f"{n} {t}" for t, n in types.most_common())
    return (f"GGUF {path.name}: {listed} tensors, {path.stat().st_size / 2**20:.1f} MiB on disk, "
            f"dequantized to {dtype} at load\n")


def _partition_text(config: EngineConfig, hf) -> str:
    return "".join(line + "\n" for line in partition_lines(config, hf)) if config.pp_size > 1 else ""
