"""EngineConfig: one frozen, validated description of an engine; CLI flags are projections of it.

Derived values are properties. Policy that needs the model (graph buckets, memory) is
resolved later by the pieces that own it, from these fields.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path

GIB = 1 << 30
PREFILL_GRAPH_CHOICES = ("auto", "breakable", "full", "compiled", "off")


def parse_bytes(value) -> int | None:
    """'4GiB', '512MiB', '2g', 1e9 -> bytes; a bare number below 4096 means GiB."""
    if value is None or isinstance(value, int):
        return value if value is None or value >= 4096 else int(value * GIB)
    if isinstance(value, float):
        return int(value * GIB) if value < 4096 else int(value)
    text = str(value).strip().lower().replace(" ", "")
    units = {"gib": GIB, "gb": 10**9, "g": GIB, "mib": 1 << 20, "mb": 10**6, "m": 1 << 20,
             "kib": 1 << 10, "kb": 1000, "k": 1 << 10, "b": 1}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            try:
                return int(float(text[: -len(suffix)]) * scale)
            except ValueError:
                break
    try:
        return parse_bytes(float(text))
    except ValueError:
        raise ValueError(f"kv_cache_memory {value!r} is not a size; write bytes or a unit, e.g. 2GiB or 512MiB.") from None


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None                    # HF dir or .gguf; None: SmolLM2-135M-Instruct; 'demo'
    tokenizer: str | None = None                # defaults to the model directory
    dtype: str = "auto"                         # auto: bf16 on bf16 CPUs if hidden >= 256, else fp32; CUDA: checkpoint's
    device: str = "auto"                        # auto: cuda when available, else cpu
    seed: int = 0
    # KV cache and scheduling
    block_size: int = 16
    kv_cache_memory: int | None = None          # bytes per stage; None = min(1 GiB, what fits)
    max_num_seqs: int = 64
    max_model_len: int | None = None            # None: the model's max_position_embeddings
    chunked_prefill_size: int = 512             # token budget of one step
    enable_prefix_caching: bool = True
    # pipeline
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    pp_sync: bool = False                       # one plan in flight (for comparison)
    pp_depth: int | None = None                 # plans in flight; None = pp_size
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None              # None: a free port (single node only)
    dist_timeout_s: float = 60.0
    dist_ifname: str | None = None              # None: the interface that routes to master_addr
    threads_per_stage: int | None = None        # None: cores / stages per node if pp_size > 1, else torch's
    # captured graphs (docs/graphs.md)
    prefill_graph: str = "auto"
    prefill_graph_max_tokens: int | None = None
    prefill_graph_buckets: tuple[int, ...] | None = None
    decode_graph: bool = False
    decode_graph_max_bs: int = 32

    def __post_init__(self):
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        for name in ("pp_layer_partition", "prefill_graph_buckets"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, _parse_int_list(name, value))
            elif value is not None:
                object.__setattr__(self, name, tuple(int(v) for v in value))
        self._validate()

    def _validate(self) -> None:
        positive = ("block_size", "max_num_seqs", "chunked_prefill_size", "pp_size", "nnodes", "decode_graph_max_bs")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.prefill_graph not in PREFILL_GRAPH_CHOICES:
            raise ValueError(f"prefill_graph must be one of {', '.join(PREFILL_GRAPH_CHOICES)}, got {self.prefill_graph!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")
        if self.pp_size % self.nnodes:
            raise ValueError(f"pp_size {self.pp_size} must be a multiple of nnodes {self.nnodes} (equal stages per node).")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, {self.nnodes}).")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("A multi-node run needs --master-port (and --master-addr) on every node.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive.")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def depth(self) -> int:
        """Plans the driver keeps in flight."""
        if self.pp_sync:
            return 1
        return self.pp_depth or self.pp_size

    @property
    def stages_per_node(self) -> int:
        return self.pp_size // self.nnodes

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, refusing unknown names with a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"Unknown engine option(s): {', '.join(unknown)}; see `stagewise serve --help`.")
        return cls(**kwargs)


def cache_root() -> Path:
    """`$STAGEWISE_CACHE`, else `~/.cache/stagewise`: the demo model, the default model, converted tokenizers."""
    return Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise")


def _parse_int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of integers, got {text!r}.") from None

