"""The C++ registration of the kernel ops: `csrc/<concern>_ops.cpp`, on PyTorch's stable ABI.

`load(name, lib)` builds that file with the system C++ compiler against torch's headers, linked
to the concern's C library `lib`, caches it beside the C libraries (keyed also by torch's version)
and loads it into the dispatcher: its CPU kernels then take precedence over the Python ones
(registered for CompositeExplicitAutograd), so compiled graphs and eager calls reach the C
kernels with no Python in between. Where it cannot be built the Python registrations stay, after
one log line; `STAGEWISE_KERNELS=required` makes that an error.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from pathlib import Path

import torch

from . import build

CXXFLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
_loaded: dict[str, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def load(name: str, lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """csrc/`name`_ops.cpp built against `lib` and registered with the dispatcher, once per
    process; its handle (for its extern "C" settings), or None where the Python ops stay."""
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _load(name, Path(lib._name))
            except build.BuildFailed as exc:
                _loaded[name] = None
                build.unavailable("C++ op registration", exc, "the ops dispatch to Python and ctypes instead")
        return _loaded[name]


def loaded(name: str) -> bool:
    """The C++ registration of `name`'s ops is active."""
    return _loaded.get(name) is not None


def _load(name: str, clib: Path) -> ctypes.CDLL:
    cxx = build.cxx_compiler()
    if cxx is None:
        raise build.BuildFailed(f"no C++ compiler (CXX={os.environ.get('CXX') or 'g++'} is not on PATH)")
    torch_dir = Path(torch.__file__).resolve().parent
    source = build.CSRC / f"{name}_ops.cpp"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    try:
        key = build.digest([source], [*CXXFLAGS, abi, torch.__version__, str(torch_dir), cxx,
                                      build.compiler_version(cxx), clib.name])
        path = clib.parent / f"{name}_ops_{key}.so"
        # the C library by file name from the same directory ($ORIGIN), torch's from its own
        libs = [f"-L{clib.parent}", f"-l:{clib.name}", "-Wl,-rpath,$ORIGIN", f"-L{torch_dir / 'lib'}",
                "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
        build.compile_into(path, [cxx, *CXXFLAGS, abi, f"-I{torch_dir / 'include'}", f"-I{build.CSRC}", str(source)],
                           libs)
        torch.ops.load_library(str(path))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        raise build.BuildFailed(f"{name}_ops: {type(exc).__name__}: {exc}") from exc
