"""A stage's side of the prefix cache's disk tier (runtime/kv_disk.py). Before a plan runs, the
stage copies out the blocks the driver asks it to save (its writer thread writes them later) and
reads in the pages the driver asks it to load; how many pages of each request it read, and its
tier's counters, travel on with the plan to the driver. A plan with no rows (only page work) runs
no forward. Every stage does this for its own layers, so a pipeline's pages live on its nodes.
"""
from __future__ import annotations

import logging

import torch

from ..parallel.partition import StageInfo
from ..plan import StepPlan, StepResult
from ..runtime.kv_disk import FORMAT_VERSION, HEADER, DiskTier, disk_tier_on, kv_dir, model_identity, stage_budget

log = logging.getLogger("stagewise.kv_disk")


class StagePages:
    """One stage's pages: its KV tensors (global layer ids `layers`) and its disk tier."""

    def __init__(self, caches: list, layers: range, tier: DiskTier):
        self.caches, self.layers, self.tier = caches, layers, tier
        self.slices, self.page_bytes = page_layout(caches, layers)

    @classmethod
    def open(cls, config, model_dir: str, stage: StageInfo, worker) -> "StagePages | None":
        """The stage's pages, or None when the tier is off (no --kv-cache-disk, or tensor parallelism)."""
        if not disk_tier_on(config):
            return None
        caches, layers = worker.batch.kv_caches, range(stage.start, stage.end)
        first = caches[stage.start]
        key = {"format": FORMAT_VERSION, "model": model_identity(model_dir), "kv_dtype": str(first.dtype),
               "weights_dtype": str(worker.dtype), "quantization": config.quantization,
               "block": list(first.shape[2:]), "layers": [stage.start, stage.end], "num_layers": stage.num_layers,
               "device": worker.device.type, "tp": [0, config.tp_size]}
        tier = DiskTier(kv_dir(config), key, page_layout(caches, layers)[1], stage_budget(config, stage))
        return cls(caches, layers, tier)

    def copy_out(self, block: int) -> torch.Tensor:
        """The block's KV of every own layer, as one uint8 page (a copy: the block may be reused next)."""
        page = torch.empty(self.page_bytes, dtype=torch.uint8)
        for layer, offset, nbytes, dtype, shape in self.slices:
            page[offset:offset + nbytes].view(dtype).view(shape).copy_(self.caches[layer][:, block])
        return page

    def copy_in(self, block: int, buf: bytearray) -> None:
        page = torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER.size)
        for layer, offset, nbytes, dtype, shape in self.slices:
            self.caches[layer][:, block].copy_(page[offset:offset + nbytes].view(dtype).view(shape))

    def save(self, plan: StepPlan) -> None:
        saves = plan.kv_saves
        if saves is None:
            return
        for block, digest in zip(saves.block_ids, saves.digests):
            key = bytes.fromhex(digest)
            if self.tier.writable and not self.tier.has(key):
                self.tier.save(key, self.copy_out(block))

    def load(self, plan: StepPlan) -> None:
        """Read each request's pages in order until one is missing or damaged; the plan keeps the
        smallest count any stage read (the driver recomputes from there)."""
        for rid, pages in plan.kv_loads.items():
            limit = min(plan.kv_loaded.get(rid, len(pages.block_ids)), len(pages.block_ids))
            n = 0
            with torch.inference_mode():
                while n < limit:
                    buf = self.tier.read(bytes.fromhex(pages.digests[n]))
                    if buf is None:
                        break
                    self.copy_in(pages.block_ids[n], buf)
                    n += 1
            plan.kv_loaded[rid] = n

    def flush(self) -> None:
        self.tier.flush()


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
