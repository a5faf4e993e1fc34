"""Inductor's on-disk cache lives under `$STAGEWISE_CACHE/inductor` once an engine (or the command
line) claims it, whichever of torch's inductor and stagewise is imported first, and a
`TORCHINDUCTOR_CACHE_DIR` the user set wins. Importing stagewise alone claims nothing. A broken
library left in it (a compile killed mid-write) is recognised from the loader's error."""
import os
import subprocess
import sys

import pytest

from stagewise.graph import compile_cache

VAR = compile_cache.VAR
CLAIM = "from stagewise.graph import compile_cache\ncompile_cache.claim()\n"     # what the compiled backend calls
PRINT_DIR = "from torch._inductor.runtime.cache_dir_utils import cache_dir; print(cache_dir())\n"


def _inductor_dir(code: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (VAR, "STAGEWISE_CACHE")}
    out = subprocess.run([sys.executable, "-c", code + PRINT_DIR], env={**clean, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_inductor_imported_first_still_uses_the_stagewise_cache(tmp_path):
    # the order that broke: torch._inductor fills the variable with its temp-dir default first
    got = _inductor_dir("import torch._inductor.config\nimport stagewise\n" + CLAIM, STAGEWISE_CACHE=str(tmp_path))
    assert got == str(tmp_path / "inductor")


@pytest.mark.slow
def test_stagewise_imported_first_uses_the_stagewise_cache(tmp_path):
    got = _inductor_dir("import stagewise\n" + CLAIM + "import torch._inductor.config\n", STAGEWISE_CACHE=str(tmp_path))
    assert got == str(tmp_path / "inductor")


@pytest.mark.slow
def test_the_users_inductor_dir_wins(tmp_path):
    mine = str(tmp_path / "mine")
    got = _inductor_dir("import torch._inductor.config\nimport stagewise\n" + CLAIM, STAGEWISE_CACHE=str(tmp_path),
                        TORCHINDUCTOR_CACHE_DIR=mine)
    assert got == mine


def test_claim_follows_a_moved_stagewise_cache(tmp_path, monkeypatch):
    env: dict[str, str] = {}
    monkeypatch.setattr(compile_cache, "_ours", [None])
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "a"))
    assert compile_cache.claim(env) == str(tmp_path / "a" / "inductor")
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "b"))      # still ours: it follows
    assert compile_cache.claim(env) == str(tmp_path / "b" / "inductor")
    env[VAR] = str(tmp_path / "user")                               # the user's: it stays
    assert compile_cache.claim(env) == str(tmp_path / "user")


def _load_error(path) -> BaseException:
    """What loading `path` raises, as Inductor's loader would pass it on (the dynamic loader's own words)."""
    import ctypes
    try:
        try:
            ctypes.CDLL(str(path))
        except OSError as exc:
            raise ImportError(str(exc)) from exc
    except ImportError as exc:
        try:
            raise RuntimeError("InductorError: the compile failed") from exc
        except RuntimeError as outer:
            return outer
    raise AssertionError(f"{path} loaded")


def test_a_broken_cached_library_is_found_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv(VAR, str(tmp_path / "inductor"))
    broken = tmp_path / "inductor" / "ab" / "cabc.main.so"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"")                                   # what a compile killed mid-write leaves
    assert compile_cache.broken_library(_load_error(broken)) == broken.resolve()
    elsewhere = tmp_path / "other" / "cabc.main.so"           # not ours to delete
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"")
    assert compile_cache.broken_library(_load_error(elsewhere)) is None
    assert compile_cache.broken_library(RuntimeError("some other compile failure")) is None
