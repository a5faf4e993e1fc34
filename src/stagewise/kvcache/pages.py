"""A stage's side of the prefix cache's disk tier (kvcache/disk_tier.py). Before a plan runs, the
stage copies out the blocks the driver asks it to save (its writer thread writes them later) and
reads in the pages the driver asks it to load; how many pages of each request it read, and its
tier's counters, travel on with the plan to the driver. A plan with no rows (only page work) runs
no forward. Every stage does this for its own layers, so a pipeline's pages live on its nodes.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..parallel.partition import StageInfo
from ..plan import StepPlan, StepResult
from ..planning.memory import disk_tier_on, kv_dir
from .disk_tier import FORMAT_VERSION, HEADER, DiskTier, model_identity, stage_budget

log = logging.getLogger("stagewise.kv_disk")
READERS = 4


class StagePages:
    """One stage's pages: its KV tensors (global layer ids `layers`) and its disk tier."""

    def __init__(self, caches: list, layers: range, tier: DiskTier):
        self.caches, self.layers, self.tier = caches, layers, tier
        self.slices, self.page_bytes = page_layout(caches, layers)
        # NOTE: file reads and their checksums release the GIL: a few at once keep a disk busy
        self.readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="stagewise-kv-reader")

    @classmethod
    def open(cls, config, model_dir: str, stage: StageInfo, worker) -> "StagePages | None":
        """The stage's pages, or None when the tier is off (no --kv-cache-disk, or tensor parallelism)."""
        if not disk_tier_on(config):
            return None
        caches, layers = worker.batch.kv_caches, range(stage.start, stage.end)
        first = caches[stage.start]
        key = {"format": FORMAT_VERSION, "model": model_identity(model_dir), "kv_dtype": _stored_name(config, first),
               "weights_dtype": str(worker.dtype), "quantization": config.load.quantization,
               "block": list(first.shape[2:]), "layers": [stage.start, stage.end], "num_layers": stage.num_layers,
               "device": worker.device.type, "tp": [0, config.parallel.tp_size]}
        tier = DiskTier(kv_dir(config), key, page_layout(caches, layers)[1], stage_budget(config, stage))
        return cls(caches, layers, tier)

    def copy_out(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' KV of every own layer as uint8 pages `[len(blocks), page_bytes]` (a copy: the
        blocks may be reused by the step that follows); one gather per layer."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.caches[self.layers[0]].device)
        pages = torch.empty(len(blocks), self.page_bytes, dtype=torch.uint8)
        for layer, offset, nbytes, dtype, shape in self.slices:
            dst = pages[:, offset:offset + nbytes].view(dtype).view(len(blocks), *shape)   # [N, 2, BS, Hkv, D]
            dst.copy_(self.caches[layer].index_select(1, idx).transpose(0, 1))
        return pages

    def copy_in(self, blocks: list[int], buf: bytearray) -> None:
        """Write pages read into `buf` (one after another, each with its header) into `blocks`."""
        stride = HEADER.size + self.page_bytes
        pages = torch.frombuffer(buf, dtype=torch.uint8).view(-1, stride)[:len(blocks), HEADER.size:]
        idx = torch.tensor(blocks, dtype=torch.long, device=self.caches[self.layers[0]].device)
        for layer, offset, nbytes, dtype, shape in self.slices:
            src = pages[:, offset:offset + nbytes].view(dtype).view(len(blocks), *shape)   # [N, 2, BS, Hkv, D]
            cache = self.caches[layer]
            cache.index_copy_(1, idx, src.transpose(0, 1).to(cache.device))

    def save(self, plan: StepPlan) -> None:
        saves = plan.kv_saves
        if saves is None or not self.tier.writable:
            return
        todo = [(b, key) for b, d in zip(saves.block_ids, saves.digests)
                if not self.tier.has(key := bytes.fromhex(d))]
        if todo:
            t0 = time.perf_counter()
            pages = self.copy_out([b for b, _ in todo])
            for row, (_, key) in zip(pages, todo):
                self.tier.save(key, row)
            self.tier.stats.save_copy_us += int((time.perf_counter() - t0) * 1e6)

    def load(self, plan: StepPlan) -> None:
        """Read each request's pages in order until one is missing or damaged (a few reads at a time);
        the plan keeps the smallest count any stage read (the driver recomputes from there)."""
        stride = HEADER.size + self.page_bytes
        for rid, pages in plan.kv_loads.items():
            keys = [bytes.fromhex(d) for d in pages.digests]
            limit = min(plan.kv_loaded.get(rid, len(keys)), len(keys))
            limit = next((i for i, key in enumerate(keys[:limit]) if not self.tier.has(key)), limit)
            buf = bytearray(limit * stride)
            view = memoryview(buf)
            slots = [view[i * stride:(i + 1) * stride] for i in range(limit)]
            ok = list(self.readers.map(self.tier.read_into, keys[:limit], slots))
            n = ok.index(False) if False in ok else limit
            if n:
                with torch.inference_mode():
                    self.copy_in(pages.block_ids[:n], buf)
            plan.kv_loaded[rid] = n

    def flush(self) -> None:
        self.tier.flush()


def _stored_name(config, cache: torch.Tensor) -> str:
    """The key's KV format: the tensor's dtype, or q8_0/q4_0 for ggml blocks (both are uint8 bytes)."""
    name = config.cache.kv_cache_dtype
    return name if name in ("q8_0", "q4_0") else str(cache.dtype)


def page_layout(caches: list, layers: range) -> tuple[list[tuple], int]:
    """Where each own layer's KV of one block sits in a page: (layer, byte offset, bytes, dtype,
    block shape) per layer, and the page's bytes."""
    slices, offset = [], 0
    for layer in layers:
        cache = caches[layer]                  # [2, NB, BS, Hkv, D]
        nbytes = cache[:, 0].numel() * cache.element_size()
        slices.append((layer, offset, nbytes, cache.dtype, (2, *cache.shape[2:])))
        offset += nbytes
    return slices, offset


def before_plan(pages: StagePages | None, plan: StepPlan, failed: bool) -> None:
    """The stage's page work of `plan`, before its deltas and rows: saves first (their blocks may be
    zeroed or rewritten by this very step), then loads (none for a plan that failed upstream)."""
    if not plan.kv_saves and not plan.kv_loads:
        if pages is not None:
            plan.kv_tier = plan.kv_tier + [pages.tier.counters()]
        return
    try:
        if pages is not None:
            pages.save(plan)
            if not failed:
                pages.load(plan)
    except Exception as exc:  # noqa: BLE001 (the pages are an optimisation: recompute instead)
        log.warning("The KV disk tier failed on a plan (%s: %s); its prefixes are recomputed.", type(exc).__name__, exc)
    for rid in plan.kv_loads:
        if pages is None or failed or rid not in plan.kv_loaded:
            plan.kv_loaded[rid] = 0
    if pages is not None:
        plan.kv_tier = plan.kv_tier + [pages.tier.counters()]


def pages_only(worker, stage: StageInfo, plan: StepPlan) -> dict | StepResult:
    """A plan with no rows (page work only): apply its deltas, run no forward (no proxy to send on)."""
    worker.apply_deltas(plan)
    return StepResult(plan.plan_id) if stage.is_last else {}


def finish_result(result, plan: StepPlan):
    """The last stage's answer carries the plan's page outcome back to the driver."""
    if isinstance(result, StepResult):
        result.kv_loaded, result.kv_tier = dict(plan.kv_loaded), list(plan.kv_tier)
    return result
