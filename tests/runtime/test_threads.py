"""Thread sizing follows the CPUs a process may use (affinity mask, cgroup CPU quota, stages per node),
the OpenMP wait default never overrides a value the user set, a stage's CPUs are its slice of the
affinity mask (pinning, when asked, and the keepers follow it), and stage processes run with the
wait policy and keepers of the driver's choice. Only the last test builds a model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagewise.config import EngineConfig
from stagewise.runtime import threads
from stagewise.runtime.cpu_pool import stage_cpus
from stagewise.runtime.threads import (
    CpuBudget,
    cgroup_quota_cpus,
    configure_threads,
    set_wait_default,
    spawn_env_defaults,
    thread_choice,
    usable_cpus,
)

AFFINITY = len(os.sched_getaffinity(0))


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARS}
    return dict(env, **extra)


def _run(code: str, env: dict | None = None, preexec_fn=None) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env or _clean_env(), capture_output=True, text=True,
                         timeout=120, preexec_fn=preexec_fn)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _fake_cgroup(tmp_path: Path, own: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup mount under tmp_path with `files` ({relative path: text}) and a /proc/self/cgroup."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(own)
    return tmp_path, proc


def test_cgroup_v2_quota_is_read_and_rounded_down(tmp_path):
    root, proc = _fake_cgroup(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cgroup_quota_cpus(root, proc) == 1.5
    assert usable_cpus(root, proc).cpus == 1                    # rounded down
    assert "quota 1.5" in usable_cpus(root, proc).why or AFFINITY == 1
    root, proc = _fake_cgroup(tmp_path, "0::/\n", {"cpu.max": "20000 100000\n"})
    assert usable_cpus(root, proc).cpus == 1                    # at least 1


def test_cgroup_tightest_ancestor_wins_and_max_is_unlimited(tmp_path):
    files = {"cpu.max": "max 100000\n", "app/cpu.max": "100000 100000\n", "app/job/cpu.max": "max 100000\n"}
    root, proc = _fake_cgroup(tmp_path, "0::/app/job\n", files)
    assert cgroup_quota_cpus(root, proc) == 1.0
    root, proc = _fake_cgroup(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_quota_cpus(root, proc) is None
    assert usable_cpus(root, proc).cpus == AFFINITY


def test_cgroup_v1_quota(tmp_path):
    files = {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
             "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
             "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    root, proc = _fake_cgroup(tmp_path, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n", files)
    assert cgroup_quota_cpus(root, proc) == 0.5
    assert usable_cpus(root, proc).cpus == 1


def test_thread_choice_follows_budget_stages_and_flag():
    one, four = CpuBudget(1, "cgroup CPU quota 1"), CpuBudget(4, "affinity 4 CPUs")
    make = EngineConfig.from_kwargs
    assert thread_choice(make(model="x"), one, current=2) == (1, "cgroup CPU quota 1, 1 stage")
    assert thread_choice(make(model="x"), four, current=8)[0] == 4      # torch's cpu_count default, capped
    assert thread_choice(make(model="x"), four, current=1)[0] == 1      # a caller that chose fewer keeps them
    assert thread_choice(make(model="x", pp_size=2), four) == (2, "affinity 4 CPUs / 2 stages on this node")
    assert thread_choice(make(model="x", pp_size=2), one)[0] == 1
    assert thread_choice(make(model="x", pp_size=4, nnodes=2, master_port=29500), four)[0] == 2
    assert thread_choice(make(model="x", threads_per_stage=3), one) == (3, "--threads-per-stage")


def test_configure_threads_at_pp1_obeys_a_quota(tmp_path, monkeypatch):
    root, proc = _fake_cgroup(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    monkeypatch.setattr(threads, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(threads, "PROC_CGROUP", str(proc))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert configure_threads(EngineConfig.from_kwargs(model="x")) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.skipif(AFFINITY < 2, reason="needs two CPUs to narrow the affinity mask")
def test_threads_follow_the_affinity_mask():
    cpu = min(os.sched_getaffinity(0))
    code = ("import os, torch; from stagewise.config import EngineConfig; "
            "from stagewise.runtime.threads import configure_threads; pp1, pp2 = EngineConfig.from_kwargs(model='x'), "
            "EngineConfig.from_kwargs(model='x', pp_size=2); torch.set_num_threads({n}); a = configure_threads(pp1); "
            "b = configure_threads(pp2); os.sched_setaffinity(0, {{{cpu}}}); torch.set_num_threads({n}); "
            "print(a, b, configure_threads(pp1), configure_threads(pp2))")
    assert _run(code.format(n=AFFINITY, cpu=cpu)) == f"{AFFINITY} {AFFINITY // 2} 1 1"
    # taskset-style: the mask is set before Python starts
    code = "import torch; from stagewise.runtime.threads import usable_cpus; print(usable_cpus().cpus)"
    assert _run(code, preexec_fn=lambda: os.sched_setaffinity(0, {cpu})) == "1"


def test_real_cgroup_quota_limits_threads():
    """A child process in a real cgroup with a 1-CPU quota (needs root and a writable cpu controller)."""
    cgroup = _make_cgroup()
    try:
        code = ("from stagewise.runtime.threads import usable_cpus; b = usable_cpus(); print(b.cpus, b.why)")
        out = _run(code, preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
        assert out.startswith("1 ") and ("quota" in out or AFFINITY == 1), out
    finally:
        cgroup.rmdir()


def _make_cgroup() -> Path:
    """A child cgroup with a 1-CPU quota, v2 where its cpu controller is enabled, else v1; skip when neither."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup")
    name = f"stagewise-test-{os.getpid()}"
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    try:
        if "cpu" in _read(v2 / "cgroup.subtree_control").split():
            (v2 / name).mkdir()
            (v2 / name / "cpu.max").write_text("100000 100000")
            return v2 / name
        if (v1 / "cpu.cfs_quota_us").exists():
            (v1 / name).mkdir()
            (v1 / name / "cpu.cfs_quota_us").write_text("100000")
            return v1 / name
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup with a CPU quota here: {exc}")
    pytest.skip("no writable cgroup CPU controller")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_wait_default_never_overrides_the_user():
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(user)
        set_wait_default(environ=env)
        assert env == user
        assert spawn_env_defaults(env).endswith("(from the environment)") and env == user
    env = {}
    set_wait_default(environ=env)
    assert env == threads.WAIT_DEFAULT
    assert spawn_env_defaults({}).endswith("(stagewise default)")
    env = {}
    set_wait_default(openmp_started=True, environ=env)          # too late for this process: leave it
    assert env == {}
    set_wait_default(environ={})                                 # the module's own record, for later tests


# the command line's process, up to its command: the default is in place and torch not yet loaded
CLI_START = ("import os, sys\nfrom stagewise import cli\ncli.COMMANDS['plan'] = lambda args: print("
             "os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules) or 0\n"
             "cli.main(['plan'])")


def test_the_command_line_sets_the_default_before_torch_and_keeps_user_values():
    expected = " ".join(str(threads.WAIT_DEFAULT.get(k)) for k in threads.WAIT_VARS)
    assert _run(CLI_START) == f"{expected} False"
    assert _run(CLI_START, _clean_env(OMP_WAIT_POLICY="ACTIVE")) == "ACTIVE None False"


@pytest.mark.slow
def test_importing_stagewise_changes_no_environment_variable():
    code = ("import os\nbefore = dict(os.environ)\nimport stagewise\nfrom stagewise import LLM, SamplingParams\n"
            "print(dict(os.environ) == before)")
    assert _run(code) == "True"


def test_stage_cpus_are_the_stages_slice_of_the_affinity_mask():
    assert stage_cpus({0, 1, 2, 3}, 2, 0, 2) == [0, 1] and stage_cpus({0, 1, 2, 3}, 2, 1, 2) == [2, 3]
    assert stage_cpus({7, 5}, 2) == [5, 7] and stage_cpus({7, 5}, 1) == [5]
    assert stage_cpus({0, 1, 2}, 1, 1, 2) == [1]               # the odd CPU is nobody's
    assert stage_cpus({0, 1}, 4, 1, 2) == [1]                  # more threads than CPUs: the whole slice
    assert stage_cpus({0}, 1, 1, 2) == []                      # no CPU of its own: none


# torch loads first where its OpenMP team is pinned (our library then shares torch's libgomp, as in
# a stage); the unpinned probe needs no torch (keepers are our own threads)
POOL_PROBE = """
import os
{torch}
from stagewise.config import EngineConfig
from stagewise.runtime import cpu_pool
pool = cpu_pool.for_stage(EngineConfig.from_kwargs(model="x"), 0, 2)
tasks = [int(t) for t in os.listdir("/proc/self/task")]
idle = sorted(sorted(os.sched_getaffinity(t)) for t in tasks if os.sched_getscheduler(t) == os.SCHED_IDLE)
others = [sorted(os.sched_getaffinity(t)) for t in tasks
          if t != os.getpid() and os.sched_getscheduler(t) != os.SCHED_IDLE]
print(sorted(os.sched_getaffinity(0)), idle, pool.pinned, pool.keepers, sorted(map(tuple, others)))
"""


@pytest.mark.slow
@pytest.mark.skipif(AFFINITY < 2, reason="needs two CPUs for a two-thread team")
def test_pinning_and_keepers_follow_the_affinity_mask():
    cpus = sorted(os.sched_getaffinity(0))[-2:]
    narrowed = (lambda: os.sched_setaffinity(0, set(cpus)))
    with_torch = POOL_PROBE.format(torch="import torch; torch.set_num_threads(2)")
    out = _run(with_torch, _clean_env(STAGEWISE_PIN_THREADS="1"), preexec_fn=narrowed)
    assert out.startswith(f"[{cpus[0]}] [[{cpus[0]}], [{cpus[1]}]] True 2 "), out   # thread 0 here, keepers on both
    assert f"({cpus[1]},)" in out.split(" 2 ", 1)[1]                                # OpenMP's thread 1 there
    out = _run(POOL_PROBE.format(torch=""), _clean_env(), preexec_fn=narrowed)     # the default: no pinning
    assert out.startswith(f"[{cpus[0]}, {cpus[1]}] [[{cpus[0]}], [{cpus[1]}]] False 2 "), out


def _children_named(prefix: str) -> list[int]:
    """Processes named `prefix...` started by this process, or forked by its warm process
    (stagewise-warm, which forks the stages)."""
    parent_of, name_of = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent_of[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            name_of[int(pid)] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
    ours = {os.getpid()} | {pid for pid, ppid in parent_of.items()
                            if ppid == os.getpid() and name_of.get(pid) == "stagewise-warm"}
    return [pid for pid, ppid in parent_of.items() if ppid in ours and name_of[pid].startswith(prefix)]


def test_stage_processes_get_the_wait_policy_and_keepers(llama_dir):
    from stagewise import LLM, SamplingParams
    with LLM(model=str(llama_dir), pp_size=2, threads_per_stage=2) as llm:
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
        stages = _children_named("stagewise-st")
        assert len(stages) == 2
        for pid in stages:
            items = Path(f"/proc/{pid}/environ").read_text().split("\0")
            env = dict(item.split("=", 1) for item in items if "=" in item)
            assert {k: env.get(k) for k in threads.WAIT_VARS} == {k: os.environ.get(k) for k in threads.WAIT_VARS}
            assert any(k in env for k in threads.WAIT_VARS)
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            assert sum(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids) == 1    # one keeper: its one CPU
