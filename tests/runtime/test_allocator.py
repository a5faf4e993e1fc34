"""The command line's memory allocator (runtime/allocator.py): tcmalloc preloaded where the machine
has it, glibc's malloc on request or where it has none."""
import os
import subprocess
import sys

import pytest

from stagewise.runtime import allocator

FOUND = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}


def test_auto_preloads_the_first_allocator_found_and_keeps_the_rest_of_the_environment():
    env = allocator.preload_env({"PATH": "/bin", "LD_PRELOAD": "libfoo.so"}, FOUND.get)
    assert env is not None
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libfoo.so" and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    only_jemalloc = allocator.preload_env({}, {"jemalloc": "libjemalloc.so.2"}.get)
    assert only_jemalloc is not None and only_jemalloc["LD_PRELOAD"] == "libjemalloc.so.2"
    # a threshold the user set wins over ours
    assert allocator.preload_env({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, FOUND.get)[
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"


@pytest.mark.parametrize("environ", [{"STAGEWISE_MALLOC": "system"}, {"LD_PRELOAD": "/opt/libjemalloc.so"},
                                     {"LD_PRELOAD": "libtcmalloc.so.4"}])
def test_nothing_changes_when_asked_for_glibc_or_an_allocator_is_preloaded(environ):
    assert allocator.preload_env(environ, FOUND.get) is None


def test_nothing_changes_where_no_allocator_is_installed():
    assert allocator.preload_env({}, lambda name: None) is None


def test_a_path_preloads_that_library_and_a_bad_value_is_one_sentence(tmp_path):
    library = tmp_path / "libmimalloc.so"
    library.write_bytes(b"")
    env = allocator.preload_env({"STAGEWISE_MALLOC": str(library)}, lambda name: None)
    assert env is not None and env["LD_PRELOAD"] == str(library)
    with pytest.raises(ValueError, match="STAGEWISE_MALLOC must be auto, system or the absolute path"):
        allocator.preload_env({"STAGEWISE_MALLOC": "fast"}, FOUND.get)
    with pytest.raises(ValueError, match="STAGEWISE_MALLOC names /nowhere/libx.so, which is not a file"):
        allocator.preload_env({"STAGEWISE_MALLOC": "/nowhere/libx.so"}, FOUND.get)
    out = subprocess.run([sys.executable, "-m", "stagewise", "generate", "--model", "demo"],
                         env={**os.environ, "STAGEWISE_MALLOC": "/nowhere/libx.so"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == ("error: STAGEWISE_MALLOC names /nowhere/libx.so, which is "
                                                          "not a file; give the path of an allocator library (e.g. "
                                                          "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), auto "
                                                          "or system."), out.stderr


def test_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.loaded(str(maps)) is None
    maps.write_text(maps.read_text() + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert allocator.loaded(str(maps)) == "libtcmalloc_minimal.so.4.5.10"
    assert allocator.loaded(str(tmp_path / "none")) is None


@pytest.mark.slow
def test_the_command_line_runs_on_tcmalloc_where_the_machine_has_it(tmp_path):
    """`stagewise generate` re-executes itself with the allocator preloaded (its log names the library
    mapped into its process), or stays on glibc's malloc where none is installed or when asked."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "STAGEWISE_MALLOC")}
    env["STAGEWISE_CACHE"] = str(tmp_path)           # "demo" builds the demo model here
    expected = allocator.preload_env(env)

    def log_line(**extra):
        out = subprocess.run([sys.executable, "-m", "stagewise", "generate", "--model", "demo", "--prompt", "Hi",
                              "--max-tokens", "2"], env={**env, **extra}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return next(ln for ln in out.stderr.splitlines() if "memory allocator:" in ln)

    line = log_line()
    if expected is None:
        assert "glibc malloc" in line and "apt install" in line, line
    else:
        assert expected["LD_PRELOAD"].split()[0].split("/")[-1].split(".so")[0] in line, line
    assert "glibc malloc (STAGEWISE_MALLOC=system)" in log_line(STAGEWISE_MALLOC="system")


def test_load_temporaries_go_back_to_the_kernel_under_tcmalloc_too():
    """Under a preloaded tcmalloc (which keeps freed pages), `release_load_temporaries` hands them
    back through tcmalloc's own interface."""
    env = allocator.preload_env({k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "STAGEWISE_MALLOC")})
    if env is None or "tcmalloc" not in env["LD_PRELOAD"]:
        pytest.skip("no tcmalloc on this machine (CI installs it)")
    code = """
from stagewise.runtime.allocator import loaded, release_load_temporaries
def rss():
    return next(int(line.split()[1]) >> 10 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
assert "tcmalloc" in loaded()
base = rss()
chunks = [bytearray(1 << 20) for _ in range(128)]
del chunks
kept = rss() - base
assert release_load_temporaries()
print(kept, rss() - base)
"""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    kept, left = (int(v) for v in done.stdout.split())
    assert kept > 96 and left < 32, (kept, left)
