"""The disk tier's parts without an engine: a stage's DiskTier (pages, checksums, budget and LRU,
a disk that fills, a directory that cannot be used, a restart's scan) and the driver's side in
BlockManager (saves queued once per registered block, probes booked past the RAM hits, the pages
every stage read kept and registered, the rest given back)."""
from __future__ import annotations

import errno
import logging
import os
import stat

import torch

from stagewise.kvcache import disk_tier
from stagewise.kvcache.block_manager import BlockManager
from stagewise.kvcache.disk_tier import HEADER, DiskTier, model_identity
from stagewise.planning import memory
from stagewise.planning.report import budget_line
from stagewise.request import Request, SamplingParams

PAGE = 4096
KEY = {"model": "m", "layers": [0, 2]}


def _page(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _digest(i: int) -> bytes:
    return bytes([i]) * 32


def _tier(tmp_path, budget: int = 64 * PAGE, key=KEY) -> DiskTier:
    return DiskTier(tmp_path / "kv", key, PAGE, budget)


def _save(tier: DiskTier, *ids: int) -> None:
    for i in ids:
        assert tier.save(_digest(i), _page(i))
    tier.flush()


def test_pages_round_trip_privately_and_survive_a_restart(tmp_path):
    tier = _tier(tmp_path)
    _save(tier, 1, 2)
    buf = tier.read(_digest(1))
    assert buf is not None and bytes(buf[HEADER.size:]) == bytes(_page(1).numpy())
    assert stat.S_IMODE(os.stat(tier.dir).st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in tier.dir.iterdir())
    again = _tier(tmp_path)                            # a new process finds them
    assert again.has(_digest(2)) and again.read(_digest(2)) is not None
    assert _tier(tmp_path, key={**KEY, "model": "other"}).read(_digest(2)) is None   # another key: another dir


def test_a_flipped_bit_is_caught_once_and_the_page_dropped(tmp_path, caplog):
    tier = _tier(tmp_path)
    _save(tier, 1)
    path = tier._path(_digest(1))
    data = bytearray(path.read_bytes())
    data[HEADER.size + 100] ^= 0x04
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="stagewise.kv_disk"):
        assert tier.read(_digest(1)) is None
        assert tier.read(_digest(1)) is None           # gone: a miss, no second warning
    assert sum("damaged" in r.getMessage() for r in caplog.records) == 1
    assert not path.exists() and tier.stats.pages_corrupt == 1


def test_the_budget_evicts_the_least_recently_used(tmp_path):
    tier = _tier(tmp_path, budget=3 * (PAGE + HEADER.size))
    _save(tier, 1, 2, 3)
    assert tier.read(_digest(1)) is not None           # 1 is now the most recent
    _save(tier, 4)
    assert not tier.has(_digest(2)) and all(tier.has(_digest(i)) for i in (1, 3, 4))
    assert tier.stats.pages_evicted == 1 and tier.bytes_on_disk <= tier.budget_bytes


def test_a_full_disk_stops_writing_with_one_warning(tmp_path, monkeypatch, caplog):
    tier = _tier(tmp_path)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_tier.os, "write", full)
    with caplog.at_level(logging.WARNING, logger="stagewise.kv_disk"):
        tier.save(_digest(1), _page(1))
        tier.flush()
        assert not tier.save(_digest(2), _page(2))     # RAM only from now on
    assert not tier.writable and tier.enabled and tier.stats.write_errors == 1
    assert sum("disk full" in r.getMessage() for r in caplog.records) == 1
    assert not list(tier.dir.glob("*.tmp")) and not list(tier.dir.glob("*.kvp"))


def test_an_unusable_directory_turns_the_tier_off(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="stagewise.kv_disk"):
        tier = DiskTier(tmp_path / "file" / "kv", KEY, PAGE, 1 << 20)
    assert not tier.enabled and not tier.save(_digest(1), _page(1)) and tier.read(_digest(1)) is None
    assert tier.counters()[0] == 0 and any("RAM only" in r.getMessage() for r in caplog.records)


def test_a_half_written_file_of_a_killed_process_is_removed(tmp_path):
    tier = _tier(tmp_path)
    _save(tier, 1)
    (tier.dir / f".{_digest(2).hex()}.kvp.123.tmp").write_bytes(b"torn")
    again = _tier(tmp_path)
    assert not list(again.dir.glob("*.tmp")) and again.has(_digest(1))


def test_model_identity_tells_files_apart(tmp_path):
    a = tmp_path / "a.gguf"
    a.write_bytes(os.urandom(5 << 20))
    before = model_identity(str(a))
    assert model_identity(str(a)) == before
    data = bytearray(a.read_bytes())
    data[-10] ^= 1
    a.write_bytes(data)
    assert model_identity(str(a)) != before


# the driver's side

def _request(rid: str, n: int, salt: str | None = None) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=4, cache_salt=salt))


def test_registered_blocks_are_saved_once_and_probed_later():
    blocks = BlockManager(num_blocks=32, block_size=4, disk_tier=True)
    req = _request("a", 18)                            # 4 full blocks before the last token
    assert blocks.match_prefix(req) == 0 and blocks.probe_disk(req) is not None
    blocks.loaded(req, 4, 0)                           # nothing on disk: every probed block goes back
    assert req.block_ids == [] and blocks.num_disk_queried_tokens == 16
    blocks.allocate(req, 18)
    blocks.register_full_blocks(req, 18)
    saves = blocks.take_saves()
    assert saves is not None and saves.block_ids == req.block_ids[:4] and blocks.take_saves() is None
    blocks.register_full_blocks(req, 18)
    assert blocks.take_saves() is None                 # once


def test_a_probe_starts_past_the_ram_hits_and_keeps_what_every_stage_read():
    blocks = BlockManager(num_blocks=32, block_size=4, disk_tier=True)
    head = _request("h", 9)                            # its 2 full blocks are in RAM
    blocks.allocate(head, 9)
    blocks.register_full_blocks(head, 9)
    blocks.take_saves()
    blocks.free_request(head)
    req = _request("r", 18)
    assert blocks.match_prefix(req) == 8
    pages = blocks.probe_disk(req)
    assert pages is not None and pages.block_ids == req.block_ids[2:] and len(pages.block_ids) == 2
    free_before = len(blocks.free)
    assert blocks.loaded(req, 2, 1) == 12              # a stage read only the first page
    assert len(req.block_ids) == 3 and len(blocks.free) == free_before + 1
    assert blocks.num_disk_hit_tokens == 4 and blocks.take_saves() is None   # read pages are not saved again
    again = _request("again", 18)
    assert blocks.match_prefix(again) == 12            # the page read is a RAM block now


def test_no_probe_without_the_tier_or_for_prompts_the_cache_skips():
    assert BlockManager(32, 4).probe_disk(_request("a", 18)) is None
    blocks = BlockManager(32, 4, disk_tier=True)
    scored = Request("s", list(range(18)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert blocks.probe_disk(scored) is None and blocks.probe_disk(_request("short", 4)) is None
    blocks.observe_tier([[0] * len(disk_tier.COUNTERS)])  # a stage could not open its tier
    assert blocks.probe_disk(_request("b", 18)) is None


def test_a_salt_changes_every_probed_digest():
    blocks = BlockManager(32, 4, disk_tier=True)
    a, b = _request("a", 18, "x"), _request("b", 18, "y")
    pa, pb = blocks.probe_disk(a), blocks.probe_disk(b)
    assert pa is not None and pb is not None and not set(pa.digests) & set(pb.digests)


def test_the_budget_splits_by_layers_and_plan_says_so(tmp_path):
    from stagewise.config import EngineConfig
    from stagewise.parallel.partition import StageInfo
    config = EngineConfig.from_kwargs(kv_cache_disk="3GiB", kv_cache_dir=str(tmp_path))
    assert memory.disk_tier_on(config) and memory.kv_dir(config) == tmp_path
    assert disk_tier.stage_budget(config, StageInfo(0, 2, 0, 10, 30)) == 1 << 30
    assert f"3.00 GiB in {tmp_path}" in budget_line(config)
    assert "off" in budget_line(EngineConfig())
    assert EngineConfig.from_kwargs(kv_cache_disk=0).cache.kv_cache_disk is None
    assert not memory.disk_tier_on(config.replace(tp_size=2))
    assert "tensor parallelism" in budget_line(config.replace(tp_size=2))


def test_the_scheduler_books_a_probe_then_runs_from_what_every_stage_read():
    from stagewise.engine.scheduler import Scheduler
    from stagewise.plan import StepResult
    sched = Scheduler(BlockManager(64, 4, disk_tier=True), max_num_seqs=4, token_budget=64)
    req = _request("a", 18)
    sched.add(req)
    plan = sched.schedule()
    assert plan is not None and plan.seqs == [] and len(plan.kv_loads["a"].block_ids) == 4
    assert sched.schedule() is None                    # nothing else of it until its pages are read
    sched.update(plan, StepResult(plan.plan_id, kv_loaded={"a": 3}))
    assert req.num_computed_tokens == req.num_cached_tokens == 12 and len(req.block_ids) == 3
    plan = sched.schedule()
    assert plan is not None and [(s.start, s.num_tokens) for s in plan.seqs] == [(12, 6)]
    assert plan.new_reqs[0].block_ids == req.block_ids and len(req.block_ids) == 5
