"""The prefix cache's disk tier end to end through `LLM` (docs/kv-cache.md): a second engine on the
same model finds the first one's prefix on disk (fewer prefill tokens, the same greedy tokens, the
one-process run without the tier as the oracle); a damaged page is dropped with a warning and
recomputed; a tier that cannot write (a budget smaller than a page, an unusable directory) leaves
serving as it was; a salt or another model file never reads another's pages; PP=2 pages per stage,
and a stage rebuilt after a SIGKILL reads them back; `stagewise serve` restarted finds its prefix."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import urllib.request
from pathlib import Path

import pytest

from stagewise import LLM, SamplingParams

pytestmark = pytest.mark.slow           # each test starts engines

BLOCK = 4
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(42)]      # 42 tokens: 10 full blocks of 4 before the last token
FULL_TOKENS = (len(PROMPT) - 1) // BLOCK * BLOCK


def _run(model, tmp: Path, salt: str | None = None, **options) -> tuple[list[int], dict, int]:
    params = SamplingParams(max_tokens=6, temperature=0.0, cache_salt=salt)
    opts = {"block_size": BLOCK, "kv_cache_disk": "64MiB", "kv_cache_dir": str(tmp / "kv"), **options}
    with LLM(model=str(model), **opts) as llm:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        stats = llm.stats()
    return out.outputs[0].token_ids, stats, out.num_cached_tokens


@pytest.fixture(scope="module")
def oracle(llama_dir):
    """Greedy tokens of the one-process run without the disk tier."""
    with LLM(model=str(llama_dir), block_size=BLOCK) as llm:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(max_tokens=6, temperature=0.0),
                           use_tqdm=False)[0]
    return out.outputs[0].token_ids


def _pages(tmp: Path) -> list[Path]:
    return sorted((tmp / "kv").rglob("*.kvp"))


def test_a_restarted_engine_reads_the_prefix_from_disk(llama_dir, tmp_path, oracle):
    first, stats1, cached1 = _run(llama_dir, tmp_path)
    assert first == oracle and cached1 == 0
    assert stats1["kv_disk"]["enabled"] and stats1["prefix_cache_disk_hits"] == 0
    pages = _pages(tmp_path)
    assert len(pages) >= FULL_TOKENS // BLOCK
    for page in pages:                     # private to the user
        assert stat.S_IMODE(page.stat().st_mode) == 0o600
        assert stat.S_IMODE(page.parent.stat().st_mode) == 0o700
    second, stats2, cached2 = _run(llama_dir, tmp_path)
    assert second == oracle
    assert cached2 == FULL_TOKENS and stats2["prefix_cache_disk_hits"] == FULL_TOKENS
    assert stats2["kv_disk"]["pages_read"] == FULL_TOKENS // BLOCK
    # only the last token was computed before decoding: one prefill row, then decode rows
    assert stats2["iteration_tokens"]["sum"] == len(PROMPT) - FULL_TOKENS + 5


def test_a_damaged_page_is_dropped_with_a_warning_and_recomputed(llama_dir, tmp_path, oracle, caplog):
    _run(llama_dir, tmp_path)
    pages = _pages(tmp_path)
    victim = pages[len(pages) // 2]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x10                       # one bit of the payload
    victim.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="stagewise.kv_disk"):
        tokens, stats, cached = _run(llama_dir, tmp_path)
    assert tokens == oracle
    assert stats["kv_disk"]["pages_corrupt"] == 1
    assert victim.read_bytes() != data     # dropped, recomputed and written again
    damaged = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged) == 1 and "checksum" in damaged[0].getMessage()
    assert cached < FULL_TOKENS            # the pages from the damaged one on were recomputed


def test_a_torn_page_is_dropped(llama_dir, tmp_path, oracle):
    _run(llama_dir, tmp_path)
    victim = _pages(tmp_path)[0]
    victim.write_bytes(victim.read_bytes()[:100])     # killed mid-write (no rename would leave this; a disk might)
    tokens, stats, _ = _run(llama_dir, tmp_path)
    assert tokens == oracle and stats["kv_disk"]["pages_corrupt"] >= 1


def test_a_budget_below_one_page_serves_from_ram(llama_dir, tmp_path, oracle):
    tokens, stats, _ = _run(llama_dir, tmp_path, kv_cache_disk="4KiB")
    assert tokens == oracle
    assert stats["kv_disk"]["pages_on_disk"] == 0 and stats["kv_disk"]["pages_dropped"] > 0
    assert _pages(tmp_path) == []


def test_an_unusable_directory_serves_from_ram(llama_dir, tmp_path, oracle, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="stagewise.kv_disk"):
        tokens, stats, _ = _run(llama_dir, tmp_path, kv_cache_dir=str(blocker / "kv"))
    assert tokens == oracle and not stats["kv_disk"]["enabled"]
    assert any("RAM only" in r.getMessage() for r in caplog.records)


def test_a_salt_never_reads_another_tenants_pages(llama_dir, tmp_path, oracle):
    _run(llama_dir, tmp_path, salt="tenant-a")
    tokens, stats, cached = _run(llama_dir, tmp_path, salt="tenant-b")
    assert tokens == oracle and cached == 0 and stats["prefix_cache_disk_hits"] == 0
    tokens, stats, cached = _run(llama_dir, tmp_path, salt="tenant-a")
    assert tokens == oracle and cached == FULL_TOKENS


def test_another_model_file_never_reuses_pages(llama_dir, tmp_path):
    _run(llama_dir, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01            # another model: one weight's bit
    weights.write_bytes(data)
    original = os.stat(llama_dir / weights.name)
    os.utime(weights, ns=(original.st_atime_ns, original.st_mtime_ns))   # even with the same mtime (a file
    # this small is hashed whole; larger ones in samples, docs/kv-cache.md)
    _, stats, cached = _run(other, tmp_path)
    assert cached == 0 and stats["prefix_cache_disk_hits"] == 0 and stats["kv_disk"]["pages_read"] == 0
    assert len({p.parent for p in _pages(tmp_path)}) == 2     # a directory per model


def test_pp2_stages_keep_their_own_pages_and_a_rebuilt_stage_reads_them(llama_dir, tmp_path, oracle):
    first, _, _ = _run(llama_dir, tmp_path, pp_size=2)
    assert first == oracle
    assert len({p.parent.name.split("-")[0] for p in _pages(tmp_path)}) == 2     # one layer range per stage
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with LLM(model=str(llama_dir), block_size=BLOCK, pp_size=2, kv_cache_disk="64MiB",
             kv_cache_dir=str(tmp_path / "kv"), pipeline_spares=False) as llm:
        second = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        stats = llm.stats()
        assert second.outputs[0].token_ids == oracle and second.num_cached_tokens == FULL_TOKENS
        assert [s["pages_read"] for s in stats["kv_disk"]["stages"]] == [FULL_TOKENS // BLOCK] * 2
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)     # rebuilt: its RAM blocks are gone
        again = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
        stats = llm.stats()
    assert again.outputs[0].token_ids == oracle
    assert stats["recovery"]["rebuilds"] == {"stage_died": 1}, stats["recovery"]
    assert again.num_cached_tokens == FULL_TOKENS and stats["prefix_cache_disk_hits"] == 2 * FULL_TOKENS


def test_stagewise_serve_finds_its_prefix_after_a_restart(llama_dir, tmp_path, oracle):
    from benchmarks.server_process import ServerProcess
    flags = ("--block-size", str(BLOCK), "--kv-cache-disk", "64MiB", "--kv-cache-dir", str(tmp_path / "kv"))
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0}}).encode()
    answers, disk_hits = [], []
    for run in range(2):                       # the same server command, started twice
        server = ServerProcess(llama_dir, tmp_path / f"server{run}.log", *flags)
        try:
            server.wait_healthy(120)
            request = urllib.request.Request(server.url + "/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as r:
                answers.append(json.loads(r.read()))
            disk_hits.append(server.metric("stagewise_prefix_cache_disk_hits_total"))
            assert server.metric("stagewise_kv_disk_budget_bytes") == [64 << 20]
        finally:
            assert server.stop() == 0, (tmp_path / f"server{run}.log").read_text()[-2000:]
    assert [a["token_ids"] for a in answers] == [oracle, oracle]
    assert [a["num_cached_tokens"] for a in answers] == [0, FULL_TOKENS]
    assert disk_hits == [[0.0], [float(FULL_TOKENS)]]        # /metrics counts the tokens read from disk
