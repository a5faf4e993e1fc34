"""Build and load the C kernels of `csrc/`: the system compiler, the stagewise cache, one switch.

`library(name, sources)` compiles csrc files (plus `isa.c`) for this CPU into one shared library
in `<cache>/kernels/`, loads it through ctypes and returns it; a later start loads it from the
cache. The cache key covers every csrc source and header, the flags, the CPU's flags and the
compiler's path and `--version`. `STAGEWISE_KERNEL_ISA` (`isa()`) narrows what "this CPU" means:
`avx2` or `portable` build every library as on a CPU without AVX-512 (or without AVX at all), and
`cpu_flags()` then reports only what such a CPU has, so every caller picks the paths it would
pick there (a build this machine cannot run fails as any build does). The compiler writes a
temporary file in the cache directory itself, renamed into place, so concurrent builders never
load a half-written library.
`STAGEWISE_KERNELS` (`mode()`): `auto` (default) returns None where a library cannot be built
(one log line with the compiler's own error output) and callers fall back to PyTorch's ops;
`required` raises `KernelError` instead, also when the compiler left out an instruction set the
CPU has (CI sets it); `off`, or the older `STAGEWISE_CPU_KERNELS=0`, turns every kernel off.
No torch here: the graph policy asks `c_compiler()` / `cxx_compiler()` cheaply.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from .. import envs

log = logging.getLogger("stagewise.kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
# -std=c11: no floating-point contraction behind the kernels' back, so results are what the
# code spells (FMA only where it asks for one)
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# instruction sets the kernels have paths for, as /proc/cpuinfo and isa.c spell them
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")
# STAGEWISE_KERNEL_ISA -> (the target flag, the CPU flags a build needs to run, the prefixes of the
# CPU flags such a CPU lacks). `avx2` is x86-64-v3 (AVX2, FMA, F16C: an AVX2-only EPYC or Core),
# `portable` the x86-64 baseline (SSE2: the kernels' portable C paths)
ISAS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "native": ("-march=native", (), ()),
    "avx2": ("-march=x86-64-v3", ("avx2", "fma", "f16c"), ("avx512", "avx_", "amx")),
    "portable": ("-march=x86-64", (), ("avx", "amx", "fma", "f16c", "xop")),
}


class KernelError(RuntimeError):
    """A kernel library could not be built or loaded while `STAGEWISE_KERNELS=required`."""


def mode() -> str:
    """The kernel switch: `auto`, `required` or `off` (read on every call: tests change it)."""
    return envs.STAGEWISE_KERNELS


def isa() -> str:
    """The build the kernels target: `native` (default), `avx2` or `portable` (read on every call)."""
    return envs.STAGEWISE_KERNEL_ISA


def isa_runs_here(name: str) -> str | None:
    """None where this machine runs the `name` build, else why not (one sentence's end)."""
    if name == "native":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is an x86 build and this machine is {platform.machine() or 'not x86'}"
    lacks = [f for f in ISAS[name][1] if f not in machine_flags()]
    return f"this CPU lacks {', '.join(lacks)}" if lacks else None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernels see them: /proc/cpuinfo's (empty where there is none
    to read), less those the build `STAGEWISE_KERNEL_ISA` names leaves out."""
    dropped = ISAS[isa()][2]
    return frozenset(f for f in machine_flags() if not f.startswith(dropped)) if dropped else machine_flags()


@functools.cache
def machine_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none to read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split(":")[-1].split())
    except OSError:
        return frozenset()


def native_bf16() -> bool:
    """The CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cache_dir() -> Path:
    """Where built libraries live: `<STAGEWISE_CACHE or ~/.cache/stagewise>/kernels`."""
    return envs.STAGEWISE_CACHE / "kernels"


def c_compiler() -> str | None:
    """The C compiler's path (`$CC`, else `cc`), or None where there is none."""
    return shutil.which(os.environ.get("CC") or "cc")


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor would use (`$CXX`, else `g++`), or None where there is none."""
    return shutil.which(os.environ.get("CXX") or "g++")


@functools.cache
def compiler_version(path: str) -> str:
    """`<path> --version`'s first line (part of the cache key: a new compiler rebuilds)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout or out.stderr).strip()


class BuildFailed(Exception):
    """Why a library is unavailable: `reason` for the log line, `detail` the compiler's output."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


_libs: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], ctypes.CDLL | None] = {}
# seconds each library this process built took (C and C++), so a command can report its first
# run's builds apart from its own work
built_seconds: list[float] = []
_lock = threading.Lock()
_logged: set[str] = set()
# why each library that failed to build is missing (by name), for the kernel report (report.py)
failures: dict[str, str] = {}


def library(name: str, sources: list[str] | tuple[str, ...], flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library `name` built from `sources` (file names in csrc/), loaded once per process.

    None where kernels are off or the build failed under `auto` (logged once); `KernelError`
    under `required`. Symbols of an ISA the CPU lacks are absent by design: ask `hasattr`.
    `flags` go after the usual ones: tests build narrower instruction sets (`-mno-avx512f`) so
    that every path of a kernel runs on one machine; such a build may lack what the CPU has."""
    current = mode()
    if current == "off":
        return None
    key = (name, tuple(sources), tuple(flags), isa())
    with _lock:
        if key not in _libs:
            try:
                _libs[key] = _load(name, tuple(sources), current, tuple(flags))
            except BuildFailed as exc:
                _libs[key] = None
                failures.setdefault(name, exc.reason)
                unavailable("CPU kernels", exc, "PyTorch's own ops run instead")
        lib = _libs[key]
    if lib is None and current == "required":
        raise KernelError(f"CPU kernel library {name!r} is unavailable (see the first error) "
                          "and STAGEWISE_KERNELS=required.")
    return lib


def unavailable(what: str, exc: BuildFailed, fallback: str) -> None:
    """Log once that `what` is unavailable and what runs instead; under `required`, raise."""
    message = f"{what} unavailable: {exc.reason}"
    if mode() == "required":
        raise KernelError(f"{message} (STAGEWISE_KERNELS=required).{_tail(exc.detail)}")
    if message not in _logged:        # a missing compiler is one line, not one per library
        _logged.add(message)
        log.warning("%s; %s (STAGEWISE_KERNELS=required makes this an error).%s", message, fallback,
                    _tail(exc.detail))


def _tail(detail: str, limit: int = 8000) -> str:
    detail = detail.strip()
    if not detail:
        return ""
    return "\nThe compiler said:\n" + (detail if len(detail) <= limit else "...\n" + detail[-limit:])


def _load(name: str, sources: tuple[str, ...], current: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    cc = c_compiler()
    if cc is None:
        raise BuildFailed(f"no C compiler (CC={os.environ.get('CC') or 'cc'} is not on PATH)")
    target = isa()
    why_not = isa_runs_here(target)
    if why_not:
        raise BuildFailed(f"STAGEWISE_KERNEL_ISA={target} cannot run here: {why_not}")
    files = [CSRC / s for s in (*sources, "isa.c")]
    # a test's narrower flags come after the target's, so they narrow the forced build too
    # the portable build's scalar loops gain nothing from -O3's unrolling but 3x the build time
    command = [cc, *FLAGS, *(("-O2",) if target == "portable" else ()), ISAS[target][0], *flags]
    try:
        key = digest(files, [*command[1:], " ".join(sorted(machine_flags())), cc, compiler_version(cc)])
        path = cache_dir() / f"{name}_{key}.so"
        compile_into(path, [*command, "-I", str(CSRC), *map(str, files)], ["-lm"])
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildFailed(f"{name!r}: {type(exc).__name__}: {exc}") from exc
    lib.stagewise_isa.restype = ctypes.c_char_p
    built = set(lib.stagewise_isa().decode().split())
    missing = sorted((cpu_flags() & set(ISA_FLAGS)) - built)
    if missing and not flags:
        message = (f"{cc} ({compiler_version(cc).splitlines()[0]}) built {name!r} without "
                   f"{', '.join(missing)} although this CPU has it; the kernels of that ISA are missing")
        if current == "required":
            raise KernelError(f"{message} (STAGEWISE_KERNELS=required).")
        log.warning("%s: a newer compiler makes them faster.", message)
    return lib


def isa_of(lib: ctypes.CDLL) -> frozenset[str]:
    """The instruction sets `lib` was built for (isa.c's `stagewise_isa`, as /proc/cpuinfo spells them)."""
    return frozenset(lib.stagewise_isa().decode().split())


def digest(files: list[Path], extra: list[str]) -> str:
    """The cache key of a library: `files`, every csrc header, and `extra` (flags, compiler, ...)."""
    h = hashlib.sha256()
    for f in sorted({*files, *CSRC.glob("*.h")}):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update("\0".join(extra).encode())
    return h.hexdigest()[:16]


def compile_into(path: Path, command: list[str], libs: list[str]) -> None:
    """Unless `path` exists: run `command -o <temporary> libs` beside it, then rename the result
    into place (same filesystem: no EXDEV, and a concurrent reader never sees half a file). A lock
    file makes the stages of one machine build once. Raises `BuildFailed` with the compiler's output."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)       # released when the file closes
        if not path.exists():
            _compile(path, command, libs)


def _compile(path: Path, command: list[str], libs: list[str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".so.tmp")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        try:
            out = subprocess.run([*command, "-o", tmp, *libs], capture_output=True, text=True, timeout=600)
        except subprocess.SubprocessError as exc:
            raise BuildFailed(f"{command[0]} did not finish building {path.name} ({exc})") from exc
        if out.returncode != 0:
            raise BuildFailed(f"{command[0]} failed building {path.name} with exit status {out.returncode}",
                              out.stderr or out.stdout)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    built_seconds.append(time.perf_counter() - t0)
    log.info("built %s in %.1f s (cached in %s)", path.name, built_seconds[-1], path.parent)
