"""A simulated node's cgroups: its memory limit, CPU set and CPU quota, on cgroup v1 (a directory per
hierarchy) or v2 (one directory), whichever mounts the controller; made per cluster under one parent
directory and removed with it once its processes are gone.
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

CFS_PERIOD_US = 100_000


class Unsupported(RuntimeError):
    """The kernel (or this container) lacks a feature the harness needs; a test skips on it."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int | None = None
    cpus: str | None = None            # a cpuset list: "0", "0-1", "0,2"
    cpu_quota: float | None = None     # CPUs' worth of time per period: 0.5 is half a CPU

    def controllers(self) -> list[str]:
        wanted = [("memory", self.memory_bytes), ("cpuset", self.cpus), ("cpu", self.cpu_quota)]
        return [name for name, value in wanted if value is not None]


def _mounts() -> tuple[dict[str, Path], Path | None]:
    """Mount points of the v1 hierarchies by controller, and the v2 mount (None if there is none)."""
    v1: dict[str, Path] = {}
    v2 = None
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, options, *_ = line.split()
        if fstype == "cgroup":
            for opt in options.split(","):
                v1.setdefault(opt, Path(mount))
        elif fstype == "cgroup2" and v2 is None:
            v2 = Path(mount)
    return v1, v2


def _own_path(controller: str) -> str:
    """This process's cgroup path in the v1 hierarchy of `controller` (or v2's, for "")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" == controllers):
            return path.lstrip("/")
    return ""


def _write(path: Path, value: object) -> None:
    try:
        path.write_text(f"{value}\n")
    except OSError as exc:
        raise RuntimeError(f"writing {value!r} to {path} failed: {exc}") from exc


def _v2_enable(root: Path, controllers: list[str]) -> None:
    """Lets `root`'s children use the controllers (the cluster directory then passes them on)."""
    for name in controllers:
        try:
            (root / "cgroup.subtree_control").write_text(f"+{name}\n")
        except OSError as exc:
            raise Unsupported(f"the cgroup v2 {name} controller cannot be enabled under {root} ({exc})") from exc


def cluster_bases(name: str, controllers: list[str]) -> dict[str, Path]:
    """One new parent directory per controller for a cluster's node cgroups; v1 nests it under this
    process's own cgroup (so the limits of the harness's own cgroup still hold)."""
    v1, v2 = _mounts()
    bases: dict[str, Path] = {}
    v2_names = [c for c in controllers if c not in v1]
    if v2_names:
        available = (v2 / "cgroup.controllers").read_text().split() if v2 else []
        if missing := [c for c in v2_names if c not in available]:
            raise Unsupported(f"the kernel has no {', '.join(missing)} cgroup controller (neither v1 nor v2)")
        assert v2 is not None
        _v2_enable(v2, v2_names)
        bases.update({c: v2 / name for c in v2_names})
    bases.update({c: v1[c] / _own_path(c) / name for c in controllers if c in v1})
    with _undone_on_error(set(bases.values())):
        if v2 and v2 / name in bases.values():
            _write(v2 / name / "cgroup.subtree_control", " ".join(f"+{c}" for c in v2_names))
        if "cpuset" in bases and "cpuset" in v1:
            _cpuset_inherit(bases["cpuset"])
    return bases


@contextmanager
def _undone_on_error(directories: set[Path]) -> Iterator[None]:
    """Makes the directories; if making or setting them up fails, removes them again."""
    made = []
    try:
        for directory in directories:
            directory.mkdir()
            made.append(directory)
        yield
    except BaseException:
        for directory in made:
            rmdir_retrying(directory, time.monotonic() + 5)
        raise


def _cpuset_inherit(directory: Path) -> None:
    """A new v1 cpuset has no CPUs and no memory nodes, so no task may join it: copy the parent's."""
    for key in ("cpuset.cpus", "cpuset.mems"):
        _write(directory / key, (directory.parent / key).read_text().strip())


class NodeCgroup:
    """The cgroup directories of one node (one per v1 hierarchy, or a shared v2 one)."""

    def __init__(self, bases: dict[str, Path], name: str, limits: Limits) -> None:
        self.dirs = {c: base / name for c, base in bases.items()}
        with _undone_on_error(set(self.dirs.values())):
            if limits.cpus is not None:
                self._cpuset(limits.cpus)
            if limits.memory_bytes is not None:
                self._memory(limits.memory_bytes)
            if limits.cpu_quota is not None:
                self._cpu(limits.cpu_quota)

    def _memory(self, limit: int) -> None:
        d = self.dirs["memory"]
        if (d / "memory.max").exists():
            _write(d / "memory.max", limit)
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", 0)   # no swap either, as memsw below
            return
        _write(d / "memory.limit_in_bytes", limit)
        # With swap accounting, memsw caps memory + swap; without it swap would stretch the limit.
        if (d / "memory.memsw.limit_in_bytes").exists():
            _write(d / "memory.memsw.limit_in_bytes", limit)

    def _cpuset(self, cpus: str) -> None:
        d = self.dirs["cpuset"]
        if not (d / "cgroup.type").exists():     # v1: mems first, or the cpuset takes no task
            _write(d / "cpuset.mems", (d.parent / "cpuset.mems").read_text().strip())
        _write(d / "cpuset.cpus", cpus)

    def _cpu(self, quota: float) -> None:
        d = self.dirs["cpu"]
        if (d / "cpu.max").exists():
            _write(d / "cpu.max", f"{int(quota * CFS_PERIOD_US)} {CFS_PERIOD_US}")
            return
        _write(d / "cpu.cfs_period_us", CFS_PERIOD_US)
        _write(d / "cpu.cfs_quota_us", int(quota * CFS_PERIOD_US))

    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in sorted(set(self.dirs.values()))]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files():
            try:
                found |= {int(p) for p in path.read_text().split()}
            except FileNotFoundError:
                pass
        return found

    def remove(self, timeout: float = 5.0) -> None:
        """Kills what is left inside, then removes the directories (a cgroup with tasks cannot go)."""
        deadline = time.monotonic() + timeout
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                kill(pid)
            time.sleep(0.05)
        for directory in set(self.dirs.values()):
            rmdir_retrying(directory, deadline)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def rmdir_retrying(directory: Path, deadline: float) -> None:
    """rmdir, retried while the kernel still counts an exiting task (EBUSY) until `deadline`."""
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def remove_stale(pattern: str, stale: Callable[[str], bool]) -> None:
    """Removes the cluster directories matching `pattern` under this process's own cgroups (where
    cluster_bases puts them) whose names `stale` accepts, with their node directories."""
    v1, v2 = _mounts()
    parents = {mount / _own_path(c) for c, mount in v1.items() if c in ("memory", "cpuset", "cpu")}
    deadline = time.monotonic() + 5
    for base in [b for parent in parents | ({v2} if v2 else set()) for b in parent.glob(pattern)]:
        if base.is_dir() and stale(base.name):
            nodes = [d for d in base.iterdir() if d.is_dir()]
            for node in nodes:
                for pid in (node / "cgroup.procs").read_text().split():
                    kill(int(pid))
            for directory in [*nodes, base]:
                rmdir_retrying(directory, deadline)
