"""The CPU memory plan: the budget from MemAvailable and the memory cgroup (v2, v1, nested, unlimited)
read through injected readers, the margin, the KV pool's cap and floor; a model too big for the node is
refused before anything loads, naming what is missing and the fewest machines (or the quantization)
that hold it, while `stagewise plan` still prints its table; the CPU KV pool holds only pages it used."""
from __future__ import annotations

import pytest
import torch

from stagewise import LLM
from stagewise.checkpoint.facts import read_facts
from stagewise.cli import main
from stagewise.config import EngineConfig
from stagewise.kvcache.tensors import allocate_kv_caches
from stagewise.parallel.partition import StageInfo
from stagewise.planning import memory
from stagewise.planning.memory import NotEnoughMemory, available_bytes, node_budget_bytes, plan_kv
from stagewise.planning.resolved import resolve_startup

GIB, MIB = 1 << 30, 1 << 20
MEMINFO = "MemTotal:       24683664 kB\nMemFree:  1000 kB\nMemAvailable:   16000000 kB\n"


def files(table: dict[str, str]):
    return table.get


def test_budget_from_meminfo_alone():
    assert available_bytes(files({"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "0::/\n"})) == 16000000 * 1024
    assert available_bytes(files({})) is None


def test_cgroup_v2_limit_counts_reclaimable_page_cache_as_free():
    base = "/sys/fs/cgroup/job/step"
    read = files({"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "0::/job/step\n",
                  f"{base}/memory.max": f"{4 * GIB}\n", f"{base}/memory.current": f"{3 * GIB}\n",
                  f"{base}/memory.stat": f"anon {2 * GIB}\nfile {GIB}\ninactive_file {GIB}\n",
                  "/sys/fs/cgroup/job/memory.max": "max\n", "/sys/fs/cgroup/job/memory.current": f"{5 * GIB}\n"})
    assert available_bytes(read) == 2 * GIB      # 4 GiB limit - (3 GiB used - 1 GiB of inactive file pages)


def test_cgroup_v1_the_tightest_level_wins_and_huge_limits_mean_none():
    read = files({"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "5:cpu:/\n4:memory:/a/b\n0::/\n",
                  "/sys/fs/cgroup/memory/a/b/memory.limit_in_bytes": "9223372036854771712\n",
                  "/sys/fs/cgroup/memory/a/b/memory.usage_in_bytes": f"{GIB}\n",
                  "/sys/fs/cgroup/memory/a/memory.limit_in_bytes": f"{8 * GIB}\n",
                  "/sys/fs/cgroup/memory/a/memory.usage_in_bytes": f"{7 * GIB}\n",
                  "/sys/fs/cgroup/memory/a/memory.stat": f"inactive_file 5\ntotal_inactive_file {GIB // 2}\n",
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{20 * GIB}\n"})
    assert available_bytes(read) == GIB + GIB // 2
    unlimited = {"/proc/self/cgroup": "4:memory:/\n", "/sys/fs/cgroup/memory/memory.limit_in_bytes":
                 "9223372036854771712\n", "/sys/fs/cgroup/memory/memory.usage_in_bytes": "1\n"}
    assert available_bytes(files(unlimited)) is None


def test_margin_and_even_shares():
    assert node_budget_bytes(20 * GIB) == 18 * GIB                   # 10%
    assert node_budget_bytes(512 * MIB) == 448 * MIB                 # at least 64 MiB
    assert memory.stage_budget_bytes(node_bytes=9 * GIB, stages_on_node=3) == 3 * GIB
    assert memory.stage_budget_bytes(node_bytes=None, stages_on_node=2) == memory.FALLBACK_CPU_BYTES


def test_kv_pool_is_capped_floored_or_explicit():
    common = dict(weights=100 * MIB, graph_buffers=0, graph_pools=0, activation=50 * MIB, block_bytes=MIB,
                  explicit_kv=None, min_blocks=10)
    plan = plan_kv(0, (0, 4), budget=GIB, cap_blocks=64, **common)
    assert plan.num_blocks == 64 and plan.kv_bytes == 64 * MIB      # capped: max_num_seqs full sequences
    assert plan_kv(0, (0, 4), budget=GIB, cap_blocks=10**6, **common).num_blocks == 1024 - 150
    with pytest.raises(NotEnoughMemory, match=r"Stage 0 needs 160\.0 MiB .* budget is 155\.0 MiB: 5\.0 MiB missing\.$"):
        plan_kv(0, (0, 4), budget=155 * MIB, cap_blocks=10**6, **common)
    explicit = plan_kv(0, (0, 4), budget=0, cap_blocks=10**6, **{**common, "explicit_kv": 3 * MIB})
    assert explicit.num_blocks == 3                                  # the user's size, whatever the budget


def _smallest_fitting(config: EngineConfig, facts) -> int:
    """The least node budget with which `config` is accepted (bisection over resolve_startup)."""
    low, high = 1, 64 * MIB
    while low < high:
        mid = (low + high) // 2
        try:
            resolve_startup(config.replace(node_memory_bytes=mid), facts)
            high = mid
        except ValueError:
            low = mid + 1
    return low


def _no_processes(patch) -> None:
    """The remedy's arithmetic with the processes' own memory set aside: a tiny model's weights are
    far smaller than a process, so no split of it would ever help otherwise."""
    for name in ("DRIVER_RUNTIME_BYTES", "STAGE_RUNTIME_BYTES", "SHARED_LIBRARY_BYTES"):
        patch.setattr(memory, name, 0)


@pytest.fixture(scope="module")
def budgets(llama_dir):
    """Least budgets for the tiny llama: one machine, two machines (one stage each), one machine in int8."""
    facts, config = read_facts(llama_dir), EngineConfig.from_kwargs(model=str(llama_dir))
    two = config.replace(pp_size=2, nnodes=2, master_port=1)
    with pytest.MonkeyPatch.context() as patch:
        _no_processes(patch)
        return (_smallest_fitting(config, facts), _smallest_fitting(two, facts),
                _smallest_fitting(config.replace(quantization="int8"), facts))


def test_a_model_too_big_is_refused_before_loading_with_the_fewest_machines(llama_dir, budgets, monkeypatch, capsys):
    one, two, int8 = budgets
    assert two < one and int8 < one
    node = (one + max(two, int8)) // 2            # too small for one machine; enough for two, or for int8
    _no_processes(monkeypatch)
    monkeypatch.setattr(memory, "available_bytes", lambda read=None: node + 64 * MIB)     # a fake MemAvailable
    monkeypatch.setattr("stagewise.runtime.setup.load_model", lambda *a, **k: pytest.fail("loaded before refusing"))
    with pytest.raises(ValueError, match=r"does not fit this machine's memory: Stage 0 needs .* MiB missing\. It fits "
                                         r"with --pp-size 2 over 2 machines like this one \(--nnodes 2\), or on this "
                                         r"machine with --quantization int8\.$"):
        LLM(model=str(llama_dir))
    assert main(["generate", "--model", str(llama_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--pp-size 2" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--model", str(llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "weights MiB" in out and "[0,4)" in out and out.strip().splitlines()[-1].startswith("does not fit: Stage 0")


def test_a_model_that_fits_starts_with_no_flags_and_plans_from_the_budget(llama_dir, budgets, monkeypatch):
    node = budgets[0] + 8 * MIB
    _no_processes(monkeypatch)
    monkeypatch.setattr(memory, "available_bytes", lambda read=None: node + 64 * MIB)
    with LLM(model=str(llama_dir), prefill_graph="off") as llm:
        plan = llm.engine.executor.memory_plans[0]
        assert plan.budget_bytes == node and plan.kv_bytes >= 8 * MIB - plan.block_bytes
        assert llm.generate("The pipeline", use_tqdm=False)[0].outputs[0].token_ids


def test_cpu_kv_pool_holds_only_the_pages_it_used():
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    before = rss()
    stage = StageInfo.single(2)
    caches = allocate_kv_caches(stage, 2048, 16, 8, 128, torch.float32, "cpu")    # 2 x 256 MiB
    assert rss() - before < 32 * MIB
    cache = caches[1]
    assert cache is not None and cache.shape == (2, 2048, 16, 8, 128) and not cache[:, :4].any()
    cache[:, 1:3] = 1.0
    assert rss() - before < 64 * MIB and cache[:, 1:3].all() and not cache[:, 3].any()


def test_a_stage_hands_back_what_loading_freed():
    """With the stage's malloc thresholds raised, freed memory stays in the process (the steps reuse
    it); what loading freed goes back once the weights are in place (`release_load_temporaries`)."""
    import subprocess
    import sys
    code = """
from stagewise.runtime.allocator import keep_freed_memory, release_load_temporaries
def rss():
    return next(int(line.split()[1]) >> 10 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
assert keep_freed_memory()
base = rss()
chunks = [bytearray(1 << 20) for _ in range(128)]   # 128 MiB in 1 MiB pieces: heap, not mmap, here
del chunks
kept = rss() - base
release_load_temporaries()
print(kept, rss() - base)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    kept, left = (int(v) for v in done.stdout.split())
    assert kept > 96 and left < 32, (kept, left)


def test_a_node_whose_sys_hides_its_cgroup_reads_the_limit_through_its_parents_view_or_says_it_does_not_know():
    """`ip netns exec` mounts a fresh /sys: /sys/fs/cgroup is empty there, but /proc/self/cgroup still
    names the node's memory cgroup, and the parent's root (/proc/PPID/root) still shows the cgroup filesystem."""
    hidden = "/proc/4321/root/sys/fs/cgroup/memory/stagewise-facts/n1"
    read = files({"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "4:memory:/stagewise-facts/n1\n0::/\n",
                  "/proc/self/stat": "99 (python (x)) S 4321 99 99", "/proc/4321/stat": "4321 (sh) S 1 1 1",
                  f"{hidden}/memory.limit_in_bytes": f"{1100 << 20}\n",
                  f"{hidden}/memory.usage_in_bytes": f"{100 << 20}\n"})
    assert available_bytes(read) == 1000 << 20 and memory.cgroup_unknown(read) is None
    blind = files({"/proc/meminfo": MEMINFO, "/proc/self/cgroup": "4:memory:/stagewise-facts/n1\n0::/\n"})
    assert available_bytes(blind) == 16000000 * 1024         # MemAvailable alone...
    assert "memory cgroup /stagewise-facts/n1 but cannot read its limit" in memory.cgroup_unknown(blind)  # ...said
    assert memory.cgroup_unknown(files({"/proc/self/cgroup": "4:memory:/\n0::/\n"})) is None
