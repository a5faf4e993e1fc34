"""Inductor's on-disk cache lives under `$STAGEWISE_CACHE/inductor` once an engine (or the command
line) claims it, whichever of torch's inductor and stagewise is imported first, and a
`TORCHINDUCTOR_CACHE_DIR` the user set wins. Importing stagewise alone claims nothing."""
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
