"""Per-stage memory plan: the stage process's own memory, weights (as held), static graph buffers,
graph pools and the activation peak come first; the KV pool gets the rest of the stage's budget.

An explicit `kv_cache_memory` sizes the KV pool directly. Otherwise the budget is 90% of the device
(shared evenly by the stages on it) on CUDA; on CPU it is the memory this process may use
(`available_bytes`: MemAvailable and the cgroup v1/v2 limit), less a margin, measured once per node
by a running process (the driver, or a node's headless process: its own memory and the libraries
it maps are in use then, not available) before any stage loads, and shared evenly by the node's
stages, each of which counts the process it adds (none where it runs in the driver's). The pool is
capped at what
`max_num_seqs` full-length sequences can use. A budget that cannot hold the weights and KV for
`min_kv_tokens` tokens is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..checkpoint.layer_kinds import recurrent_layers, state_bytes_per_request
from ..config import cache_root

if TYPE_CHECKING:
    import torch

    from ..checkpoint.facts import ModelFacts
    from ..config import EngineConfig
    from ..parallel.partition import StageInfo

CUDA_UTILIZATION = 0.9
MARGIN_FRACTION = 0.1              # of the available memory: allocator slack, page cache the kernel keeps
MIN_MARGIN_BYTES = 64 << 20
FALLBACK_CPU_BYTES = 2 << 30       # per stage, where the OS says nothing (not Linux)
MIN_KV_TOKENS = 4096               # a stage must hold KV for this many tokens (or max_model_len)
# A process's memory before any weight, after importing torch 2.13 (CPU build), our kernels and the
# stage (or engine) modules, measured on x86-64 Linux (/proc/self/status). Its libraries' pages are
# mapped from files (RssFile, 76-81 MiB): the page cache holds one copy per node however many
# processes map them, and the process that measures a node's memory has mapped them already, so
# budgets never count them again (only a predicted peak does). Its own (anonymous) memory counts per process:
# 149 MiB for a stage process (a warm process too), 179 MiB for the driver with the tokenizer loaded; each
# rounded up for the thread pools and allocator arenas that start with the first step.
SHARED_LIBRARY_BYTES = 96 << 20
STAGE_RUNTIME_BYTES = 176 << 20
DRIVER_RUNTIME_BYTES = 208 << 20
_NO_LIMIT_BYTES = 1 << 60          # cgroup v1 writes "no limit" as a huge page-rounded number
GIB = float(1 << 30)

Reader = Callable[[str], "str | None"]


def read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def meminfo_available(read: Reader = read_text) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes."""
    for line in (read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


# Where the cgroup filesystems are: this process's view of /sys, else an ancestor's (a node started
# by `ip netns exec` has a fresh /sys that hides them; its parent's /proc/PID/root still shows them)
CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_roots(read: Reader) -> list[str]:
    roots, pid = [CGROUP_ROOT], "self"
    for _ in range(8):                  # a few ancestors: the shell or launcher that made the namespace
        stat = read(f"/proc/{pid}/stat") or ""
        fields = stat.rpartition(")")[2].split()
        if len(fields) < 2 or fields[1] in ("0", "1"):
            break
        pid = fields[1]
        roots.append(f"/proc/{pid}/root{CGROUP_ROOT}")
    return [*roots, f"/proc/1/root{CGROUP_ROOT}"]


def _own_cgroups(read: Reader) -> list[tuple[str, str]]:
    """(version, path) of this process's memory cgroup, as /proc/self/cgroup names it."""
    found = []
    for line in (read("/proc/self/cgroup") or "").splitlines():
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if num == "0" and controllers == "":
            found.append(("v2", path))
        elif "memory" in controllers.split(","):
            found.append(("v1", path))
    return found


def _mount(read: Reader, version: str, path: str) -> str | None:
    """The first cgroup root (this process's view, then its ancestors') where this process's memory
    cgroup (`path`) can be read."""
    path = path.rstrip("/")
    for root in _cgroup_roots(read):
        if version == "v1" and read(f"{root}/memory{path}/memory.usage_in_bytes") is not None:
            return f"{root}/memory"
        if version == "v2" and read(f"{root}{path}/memory.current") is not None:
            return root
    return None


def _cgroup_dirs(read: Reader) -> list[tuple[str, str]]:
    """(directory, version) of this process's memory cgroup and its ancestors (each may set a limit)."""
    dirs = []
    for version, path in _own_cgroups(read):
        mount = _mount(read, version, path)
        if mount is None:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [("/".join([mount, *parts[:n]]), version) for n in range(len(parts), -1, -1)]
    return dirs


def cgroup_unknown(read: Reader = read_text) -> str | None:
    """Why this node cannot know its cgroup's limit (it is in a memory cgroup whose files no view
    shows), else None: the planner then goes by MemAvailable alone, which may be more than it may use."""
    hidden = [path for version, path in _own_cgroups(read)
              if path not in ("", "/") and _mount(read, version, path) is None]
    if not hidden:
        return None
    return (f"this node is in memory cgroup {hidden[0]} but cannot read its limit (no cgroup filesystem under "
            f"{CGROUP_ROOT} in its view or its parents'); its plan goes by MemAvailable, which may be more than "
            f"the cgroup allows")


def _int(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _stat(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def cgroup_available(read: Reader = read_text) -> int | None:
    """What the memory cgroup limits (v2 memory.max, v1 memory.limit_in_bytes, at any level) still
    allow: limit - (usage - inactive file pages, which the kernel reclaims first). None: no limit."""
    room = None
    for path, version in _cgroup_dirs(read):
        names = (("memory.max", "memory.current", "inactive_file") if version == "v2"
                 else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        limit, usage = _int(read(f"{path}/{names[0]}")), _int(read(f"{path}/{names[1]}"))
        if limit is None or usage is None or limit >= _NO_LIMIT_BYTES:
            continue
        left = limit - max(0, usage - _stat(read(f"{path}/memory.stat"), names[2]))
        room = left if room is None else min(room, left)
    return room


def available_bytes(read: Reader = read_text) -> int | None:
    """Memory this process may still use: the smaller of MemAvailable and the cgroup's room; None
    where the OS says neither (then planning falls back to FALLBACK_CPU_BYTES per stage)."""
    known = [b for b in (meminfo_available(read), cgroup_available(read)) if b is not None]
    return max(0, min(known)) if known else None


def node_budget_bytes(available: int) -> int:
    """The engine's share of `available` (measured by a running process): less a margin of 10% (at
    least MIN_MARGIN_BYTES)."""
    return max(0, available - max(int(available * MARGIN_FRACTION), MIN_MARGIN_BYTES))


def in_process(config: EngineConfig) -> bool:
    """Whether the one stage runs in the driver's process (one stage, no tensor parallelism)."""
    return config.parallel.pp_size == 1 and config.parallel.tp_size == 1 and config.cluster.nnodes == 1


def process_bytes(shares_driver: bool) -> int:
    """What a stage adds to its node before any weight: nothing where it runs in the driver's process
    (running when the node's memory was measured), else a stage process. With --pipeline-spares the
    stage is forked from the node's warm process and shares its imported modules, so the warm
    process and its stage together hold about one process's worth (counted per stage: a node of
    several stages is over-counted by the modules they share)."""
    return 0 if shares_driver else STAGE_RUNTIME_BYTES


def measured_node_bytes() -> int | None:
    """This node's budget measured now (None where the OS says nothing)."""
    available = available_bytes()
    return None if available is None else node_budget_bytes(available)


def min_kv_blocks(max_len: int, block_size: int) -> int:
    """The smallest KV pool a planned stage accepts: MIN_KV_TOKENS (at most max_len) plus reserved block 0."""
    return -(-min(max_len, MIN_KV_TOKENS) // block_size) + 1


def stage_budget_bytes(*, node_bytes: int | None, stages_on_node: int, device_total: int | None = None,
                       stages_on_device: int = 1) -> int:
    """One stage's budget: its share of the CUDA device, or of the node's CPU budget."""
    if device_total is not None:
        return int(device_total * CUDA_UTILIZATION) // stages_on_device
    if node_bytes is None:
        return FALLBACK_CPU_BYTES
    return node_bytes // stages_on_node


@dataclass
class MemoryPlan:
    stage: int
    layers: tuple[int, int]
    budget_bytes: int
    weights_bytes: int
    graph_buffer_bytes: int
    graph_pool_bytes: int
    activation_bytes: int
    kv_bytes: int
    num_blocks: int
    block_bytes: int
    process_bytes: int = 0        # the stage's process before any weight
    state_bytes: int = 0          # recurrent-state slots (linear-attention layers) for max_num_seqs requests

    @property
    def fixed_bytes(self) -> int:
        return (self.process_bytes + self.weights_bytes + self.graph_buffer_bytes + self.graph_pool_bytes
                + self.activation_bytes + self.state_bytes)

    def peak_bytes(self, kv_tokens: int, block_size: int, running: int = 0) -> int:
        """What the stage adds at its peak with `kv_tokens` of KV written (the CPU pool is resident
        only as blocks are written), plus `running`: what was in use before it (e.g. the driver's
        process and the libraries, where the stage runs in it)."""
        used = min(self.num_blocks, -(-kv_tokens // block_size) + 1) * self.block_bytes
        return running + self.fixed_bytes + used

    def row(self, state: bool = False) -> list[str]:
        """The table's cells; `state`: with the recurrent-state column (a model with linear-attention layers)."""
        mib = lambda b: f"{b / (1 << 20):.1f}"
        return [str(self.stage), f"[{self.layers[0]},{self.layers[1]})", mib(self.process_bytes),
                mib(self.weights_bytes),
                mib(self.graph_buffer_bytes), mib(self.graph_pool_bytes), mib(self.activation_bytes),
                *([mib(self.state_bytes)] if state else []), mib(self.kv_bytes), str(self.num_blocks)]


class NotEnoughMemory(ValueError):
    """A stage's budget cannot hold its weights, activations and the smallest KV pool."""

    def __init__(self, plan: MemoryPlan, min_kv_bytes: int):
        self.plan, self.missing_bytes = plan, plan.fixed_bytes + min_kv_bytes - plan.budget_bytes
        super().__init__(f"Stage {plan.stage} needs {size_text(plan.fixed_bytes + min_kv_bytes)} (its process "
                         f"{size_text(plan.process_bytes)}, weights {size_text(plan.weights_bytes)}, activations and "
                         f"graphs {size_text(plan.fixed_bytes - plan.weights_bytes - plan.process_bytes)}, the "
                         f"smallest KV pool {size_text(min_kv_bytes)}) but its memory budget is "
                         f"{size_text(plan.budget_bytes)}: "
                         f"{size_text(self.missing_bytes)} missing.")


def size_text(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def estimate_activation_bytes(num_tokens: int, hidden: int, intermediate: int, vocab: int,
                              max_num_seqs: int, itemsize: int) -> int:
    """A forward's transient peak: a few hidden-sized tensors, the MLP, and the sampled logits."""
    return num_tokens * (8 * hidden + 3 * intermediate) * itemsize + max_num_seqs * vocab * 4 * 2


def plan_kv(stage: int, layers: tuple[int, int], *, weights: int, graph_buffers: int, graph_pools: int,
            activation: int, block_bytes: int, explicit_kv: int | None, budget: int, cap_blocks: int,
            min_blocks: int, refuse: bool = True, process: int = 0, state: int = 0) -> MemoryPlan:
    """The stage's plan: an explicit KV size as given, else the budget's rest up to `cap_blocks`.
    Raises NotEnoughMemory (with `refuse`) when the rest holds fewer than `min_blocks` blocks."""
    fixed = process + weights + graph_buffers + graph_pools + activation + state
    if explicit_kv is not None:
        kv = explicit_kv
        budget = fixed + kv
    else:
        kv = min(budget - fixed, cap_blocks * block_bytes)
    num_blocks = max(0, kv // block_bytes)
    plan = MemoryPlan(stage, layers, budget, weights, graph_buffers, graph_pools, activation,
                      num_blocks * block_bytes, num_blocks, block_bytes, process, state)
    problem = shortfall(plan, explicit_kv, min(min_blocks, cap_blocks))
    if problem is not None and refuse:
        raise problem
    if num_blocks < 2 and refuse:
        raise ValueError(f"Stage {stage}'s KV cache of {kv / (1 << 20):.2f} MiB holds {num_blocks} blocks of "
                         f"{block_bytes / (1 << 20):.2f} MiB; it needs at least 2 — raise kv_cache_memory.")
    return plan


def stage_plan(config: EngineConfig, facts: ModelFacts, stage: StageInfo, itemsize: int, *, weights: int,
               graph_buffers: int, block_bytes: int, budget: int, process: int, refuse: bool = True) -> MemoryPlan:
    """One stage's plan from the engine's options and the model's facts: the one place the activation
    peak, the KV cap (`max_num_seqs` full-length sequences) and the KV floor are worked out, for a
    stage that loads (runtime/setup.py), `stagewise plan` and the cluster planner alike."""
    max_len = facts.max_len(config.scheduler.max_model_len)
    activation = estimate_activation_bytes(config.scheduler.chunked_prefill_size, facts.hidden, facts.intermediate,
                                           facts.vocab, config.scheduler.max_num_seqs, itemsize)
    return plan_kv(stage.rank, (stage.start, stage.end), weights=weights, graph_buffers=graph_buffers, graph_pools=0,
                   activation=activation, process=process, block_bytes=block_bytes,
                   state=config.scheduler.max_num_seqs * recurrent_state_bytes(facts.hf, stage, itemsize),
                   explicit_kv=config.cache.kv_cache_memory,
                   budget=budget, cap_blocks=cap_blocks(config, max_len),
                   min_blocks=min_kv_blocks(max_len, config.cache.block_size), refuse=refuse)


def cap_blocks(config: EngineConfig, max_len: int) -> int:
    """The KV blocks `max_num_seqs` full-length sequences can use, plus the reserved block 0."""
    return config.scheduler.max_num_seqs * -(-max_len // config.cache.block_size) + 1


def shortfall(plan: MemoryPlan, explicit_kv: int | None, min_blocks: int) -> NotEnoughMemory | None:
    """The refusal of a plan whose KV pool is below `min_blocks` (an explicit size is the user's call)."""
    if explicit_kv is None and plan.num_blocks < min_blocks:
        return NotEnoughMemory(plan, min_blocks * plan.block_bytes)
    return None


def format_memory_table(plans: list[MemoryPlan], labels: list[str] | None = None) -> str:
    """One row per plan; `labels` replace the stage numbers (tensor-parallel ranks: stage/rank)."""
    state = any(p.state_bytes for p in plans)     # recurrent-state slots: shown where a stage has any
    head = ["stage" if labels is None else "stage/rank", "layers", "process MiB", "weights MiB", "graph bufs MiB",
            "graph pools MiB", "activations MiB", *(["state MiB"] if state else []), "KV MiB", "KV blocks"]
    rows = [head] + [p.row(state) for p in plans]
    for row, label in zip(rows[1:], labels or []):
        row[0] = label
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    # NOTE: a 135M model's default pool reads "11520.4" (64 sequences of 8,192 tokens): say what it is
    note = ("KV MiB is each pool's ceiling (--max-num-seqs sequences of --max-model-len tokens, or the memory left), "
            "resident only as blocks are written on CPU; --max-num-seqs, --max-model-len or --kv-cache-memory "
            "lower it." + (" state MiB: the recurrent state of --max-num-seqs requests (linear-attention layers, "
                           "a fixed size per request whatever its length)." if state else ""))
    return "\n".join(["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows] + [note])


def kv_layers(hf_config, stage: StageInfo) -> int:
    """The stage's layers that hold KV blocks: all but the recurrent ones (linear attention)."""
    recurrent = set(recurrent_layers(hf_config)) if hf_config is not None else set()
    return sum(1 for i in range(stage.start, stage.end) if i not in recurrent)


def recurrent_state_bytes(hf_config, stage: StageInfo, itemsize: int) -> int:
    """One request's recurrent-state slot over the stage's linear-attention layers (0: none)."""
    if hf_config is None or not getattr(hf_config, "layer_types", None):
        return 0
    return state_bytes_per_request(hf_config, range(stage.start, stage.end), itemsize)


def kv_bytes_per_block(stage: StageInfo, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, kv_dtype: str = "auto", hf_config=None) -> int:
    """K and V of one block over the stage's layers, stored as `kv_dtype` (--kv-cache-dtype; auto: `dtype`),
    and, for a format other than `dtype`, the block's share of the dense copy of one layer that
    attention reads a stored layer through (model/attention.py: one per stage, resident as used).
    With `hf_config`, recurrent layers (which hold no blocks) are not counted."""
    from ..kernels import kv_quant  # here: the plan's arithmetic is read by processes that never load torch
    row = kv_quant.row_bytes(kv_dtype, head_dim, dtype)
    layers = kv_layers(hf_config, stage) if hf_config is not None else stage.end - stage.start
    if layers == 0:         # only recurrent layers: no block costs this stage anything (1 keeps the plan's division)
        return 1
    stored = 2 * block_size * num_kv_heads * row * layers
    same = kv_quant.storage_dtype(kv_dtype, dtype) == dtype
    dense = 0 if same else 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
    return stored + dense


def disk_tier_on(config) -> bool:
    """Whether this engine keeps pages on disk: a budget was given (--kv-cache-disk), the prefix
    cache is on, and the stages are not tensor-parallel (their ranks' shards are not paged yet)."""
    return bool(config.cache.kv_cache_disk) and config.cache.enable_prefix_caching and config.parallel.tp_size == 1


def kv_dir(config) -> Path:
    """--kv-cache-dir, else `$STAGEWISE_CACHE/kv`."""
    return Path(config.cache.kv_cache_dir) if config.cache.kv_cache_dir else cache_root() / "kv"
