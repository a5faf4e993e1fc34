"""CPU threads of a stage: how many (the CPUs this process may use, from its affinity mask and
its cgroup CPU quota, shared by the stages of this node) and how idle OpenMP threads wait.

The wait policy is an environment default that only counts if it is set before the OpenMP
runtime starts (before torch is imported, or in a spawned child's environment); the command line
(before torch loads) and the stage launcher apply it; importing stagewise does not. torch is
imported lazily: this module must load first.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("stagewise.threads")

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# NOTE: measured in benchmarks/results/threads.md (2 shared cores, with and without another process
# keeping one busy): policies that spin long (GNU's default 300k spins, ACTIVE, GOMP_SPINCOUNT 1e4-1e5)
# made 1.7-14x less than PASSIVE whenever anything else ran, since a barrier waits for a descheduled
# spinner; PASSIVE kept loaded/quiet at 0.55 and had the best batch-1 decode. Spinning can win on an
# idle, dedicated machine; users opt in there with OMP_WAIT_POLICY / GOMP_SPINCOUNT.
WAIT_DEFAULT = {"OMP_WAIT_POLICY": "PASSIVE"}

_wait_source = ""               # how this process's OpenMP wait policy was chosen (for the log line)
_defaulted = False               # whether os.environ's wait variables were put there by stagewise
_logged: set[str] = set()


@dataclass(frozen=True)
class CpuBudget:
    """CPUs this process may keep busy, and what limited them (for the start-up line)."""
    cpus: int
    why: str


def cgroup_quota_cpus(root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> float | None:
    """CPUs allowed by the cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`):
    the tightest over this process's cgroup and its ancestors, None when nothing limits it.
    `root` (the cgroup mount) and `proc_cgroup` (/proc/self/cgroup) are for tests."""
    dirs = _cgroup_dirs(Path(root or CGROUP_ROOT), Path(proc_cgroup or PROC_CGROUP))
    limits = [q for d in dirs if (q := _quota_in(d)) is not None]
    return min(limits, default=None)


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup v2 and v1-`cpu` directories under root, and every ancestor up to root."""
    own = _own_cgroups(proc_cgroup)
    bases = ((root, own.get("v2")), (root / "cpu", own.get("cpu")), (root / "cpu,cpuacct", own.get("cpu")))
    dirs = []
    for base, rel in bases:
        parts = Path((rel or "/").lstrip("/")).parts
        dirs += [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def _own_cgroups(proc_cgroup: Path) -> dict[str, str]:
    """{'v2': path, 'cpu': path} from /proc/self/cgroup lines `id:controllers:path`."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    own = {}
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            own["v2"] = path
        elif "cpu" in controllers.split(","):
            own["cpu"] = path
    return own


def _quota_in(cgroup_dir: Path) -> float | None:
    try:
        if (cgroup_dir / "cpu.max").exists():
            quota, period = (cgroup_dir / "cpu.max").read_text().split()[:2]
        elif (cgroup_dir / "cpu.cfs_quota_us").exists():
            quota = (cgroup_dir / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup_dir / "cpu.cfs_period_us").read_text().strip()
        else:
            return None
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


def usable_cpus(root: str | Path | None = None, proc_cgroup: str | Path | None = None) -> CpuBudget:
    """The CPUs this process may use: its affinity mask, lowered by a cgroup quota (rounded down, at least 1)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_quota_cpus(root, proc_cgroup)
    if quota is not None and max(1, math.floor(quota)) < affinity:
        return CpuBudget(max(1, math.floor(quota)), f"cgroup CPU quota {quota:g}")
    return CpuBudget(affinity, f"affinity {affinity} CPU{'s' * (affinity != 1)}")


def intra_op_threads(config, budget: CpuBudget | None = None) -> int | None:
    """Threads for one stage process: `threads_per_stage`, else under PP the usable CPUs shared evenly by
    the node's stages (one stage per core on a 2-core box). None at PP=1: the stage runs in the caller's
    process, whose own setting stands, only capped to the usable CPUs (see `configure_threads`)."""
    if config.parallel.pp_size == 1 and config.parallel.tp_size == 1 and not config.parallel.threads_per_stage:
        return None
    return thread_choice(config, budget)[0]


def thread_choice(config, budget: CpuBudget | None = None, current: int | None = None) -> tuple[int, str]:
    """(threads, why) for a stage of `config` in a process whose torch setting is `current`."""
    budget = budget or usable_cpus()
    if config.parallel.threads_per_stage:
        return config.parallel.threads_per_stage, "--threads-per-stage"
    if config.parallel.pp_size > 1 or config.parallel.tp_size > 1:
        k = config.ranks_per_node
        threads = max(1, budget.cpus // k)
        what = "stage" if config.parallel.tp_size == 1 else "stage rank"
        return threads, f"{budget.why} / {k} {what}{'s' * (k != 1)} on this node"
    if current is not None and current < budget.cpus:
        return current, f"the caller's torch setting ({budget.why})"
    return budget.cpus, f"{budget.why}, 1 stage"


def configure_threads(config) -> int:
    """Set torch's intra-op threads for a stage in this process; log the choice once."""
    import torch
    threads, why = thread_choice(config, current=torch.get_num_threads())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    log_once(f"CPU threads: {threads} per stage ({why}); OpenMP wait: {wait_policy_line()}")
    return threads


def log_once(line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        log.info(line)


def set_wait_default(openmp_started: bool = False, environ=os.environ) -> None:
    """Put the measured wait default in `environ` unless the user set any wait variable (theirs win).
    `openmp_started`: torch is already loaded here, so the default can only reach child processes."""
    global _wait_source
    if openmp_started and not _user_set(environ):
        _wait_source = "GNU OpenMP's default spin: torch was imported before stagewise"
    else:
        _wait_source = spawn_env_defaults(environ)


def spawn_env_defaults(environ=os.environ) -> str:
    """Give `environ` (which spawned stage processes inherit) the wait default unless the user set a
    wait variable; returns the policy line those processes will see."""
    global _defaulted
    just_set = not _user_set(environ)
    if just_set:
        environ.update(WAIT_DEFAULT)
    _defaulted = _defaulted or (just_set and environ is os.environ)
    # NOTE: the command line already defaulted os.environ: that is still ours, not the user's
    ours = just_set or (environ is os.environ and _defaulted and
                        all(environ.get(k) == v for k, v in WAIT_DEFAULT.items()))
    return _describe(environ, "stagewise default" if ours else "from the environment")


def wait_policy_line() -> str:
    """How this process's OpenMP threads wait, and where that came from."""
    return _wait_source or _describe(os.environ, "this process's environment")


def _user_set(environ) -> bool:
    return any(k in environ for k in WAIT_VARS)


def _describe(environ, source: str) -> str:
    values = " ".join(f"{k}={environ[k]}" for k in WAIT_VARS if k in environ) or "GNU OpenMP's default spin"
    return f"{values} ({source})"
