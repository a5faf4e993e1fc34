"""Where Inductor keeps compiled code between starts: `$STAGEWISE_CACHE/inductor` (default
`~/.cache/stagewise/inductor`) unless the user set `TORCHINDUCTOR_CACHE_DIR`.

Plain Python, no torch: the package `__init__` claims the variable before torch can. Importing
`torch._inductor` writes torch's own default (a temp directory) into the environment, after
which a later `setdefault` could no longer tell it from a user's choice.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ..config import cache_root

VAR = "TORCHINDUCTOR_CACHE_DIR"
_ours: list[str | None] = [None]       # the value stagewise put there (replaced when STAGEWISE_CACHE moves)


def compile_cache_dir() -> str:
    """The stagewise Inductor cache directory (follows `STAGEWISE_CACHE` at call time)."""
    return str(cache_root() / "inductor")


def _torch_default_dir() -> str | None:
    """What torch writes into the variable when it finds it unset (None while inductor is not loaded)."""
    if "torch._inductor" not in sys.modules:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return os.path.abspath(default_cache_dir())


def claim(environ=os.environ) -> str:
    """Point Inductor at the stagewise cache unless the user chose a directory; returns the one in use.

    Unset, ours (from an earlier call, perhaps under another `STAGEWISE_CACHE`) or torch's own
    default (inductor was imported first) all mean no user choice. Called at import and again
    when a compiled backend is built."""
    current = environ.get(VAR)
    if current is None or current == _ours[0] or current == _torch_default_dir():
        environ[VAR] = _ours[0] = compile_cache_dir()
    return environ[VAR]


# the loader's complaint about a shared library that is not one (a compile killed mid-write leaves
# an empty or cut `.so` that Inductor's cache then finds and loads on every start)
_BROKEN = re.compile(r"(/\S+\.so): (?:file too short|invalid ELF header|ELF load command|no section header)")


def broken_library(exc: BaseException) -> Path | None:
    """The cached library under the Inductor cache that `exc` (or an exception it came from) failed
    to load because the file is broken, or None (then it is some other failure)."""
    root = Path(os.environ.get(VAR) or compile_cache_dir()).resolve()
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        found = _BROKEN.search(str(cur))
        if found:
            path = Path(found.group(1)).resolve()
            if path.is_relative_to(root) and path.is_file():
                return path
        cur = cur.__cause__ or cur.__context__
    return None
