"""The kernel build: a cache directory on another filesystem than $TMPDIR, the switch
(`STAGEWISE_KERNELS` / `STAGEWISE_CPU_KERNELS`), a missing and a broken compiler (the compiler's own
output logged, or raised under `required`), the compiler in the cache key, an instruction set
the compiler left out, and the forced builds of `STAGEWISE_KERNEL_ISA`. Most cases build `isa.c`
alone (`library(name, [])`): a tenth of a second."""
import logging
import os
import stat

import pytest

from stagewise.kernels import build


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """A process-fresh build module: its own cache directory, no libraries loaded, nothing logged."""
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setattr(build, "_logged", set())
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("STAGEWISE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("STAGEWISE_KERNEL_ISA", raising=False)
    monkeypatch.setenv("STAGEWISE_KERNELS", "auto")


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _files(cache) -> list[str]:
    """The suffixes of the files in `cache`, lock files aside."""
    return sorted(p.suffix for p in cache.iterdir() if p.suffix != ".lock")


def test_cache_on_another_filesystem_than_tmpdir(monkeypatch, tmp_path):
    """The library is compiled inside the cache directory, so a cache on tmpfs with $TMPDIR on disk
    (the os.replace across filesystems that used to fail with EXDEV) builds and loads."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's temporary directory")
    cache = f"/dev/shm/stagewise-test-{os.getpid()}"
    monkeypatch.setenv("STAGEWISE_CACHE", cache)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    try:
        lib = build.library("exdev", [])
        assert lib is not None and lib.stagewise_isa() is not None
        assert _files(build.cache_dir()) == [".so"]       # no temporary left behind
    finally:
        for p in build.cache_dir().glob("*"):
            p.unlink()
        os.removedirs(build.cache_dir())


def test_a_second_process_loads_from_the_cache(monkeypatch):
    first = build.library("cached", [])
    path = next(build.cache_dir().iterdir())
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("rebuilt a cached library"))
    assert first is not None and build.library("cached", []) is not None and path.exists()


def test_switch(monkeypatch):
    monkeypatch.setenv("STAGEWISE_KERNELS", "off")
    assert build.mode() == "off" and build.library("off", []) is None
    monkeypatch.setenv("STAGEWISE_KERNELS", "required")
    monkeypatch.setenv("STAGEWISE_CPU_KERNELS", "0")            # the older spelling of off still wins
    assert build.mode() == "off"
    monkeypatch.delenv("STAGEWISE_CPU_KERNELS")
    monkeypatch.setenv("STAGEWISE_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="STAGEWISE_KERNELS must be one of auto, required, off"):
        build.mode()


def test_no_compiler_is_one_log_line_or_an_error(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="stagewise.kernels"):
        assert build.library("one", []) is None and build.library("two", []) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C compiler (CC=/nonexistent/cc is not on PATH)" in lines[0]
    monkeypatch.setenv("STAGEWISE_KERNELS", "required")
    with pytest.raises(build.KernelError, match="no C compiler"):
        build.library("three", [])


def test_a_broken_compiler_is_logged_with_its_own_output(monkeypatch, tmp_path, caplog):
    cc = _script(tmp_path / "badcc", 'if [ "$1" = --version ]; then echo "badcc 1.0"; exit 0; fi\n'
                                     'echo "gemm.c:12:3: error: the compiler says no" >&2; exit 1\n')
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.WARNING, logger="stagewise.kernels"):
        assert build.library("broken", []) is None
    assert "exit status 1" in caplog.text and "gemm.c:12:3: error: the compiler says no" in caplog.text
    assert _files(build.cache_dir()) == []                # the temporary file is gone
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setenv("STAGEWISE_KERNELS", "required")
    with pytest.raises(build.KernelError, match="(?s)exit status 1.*the compiler says no"):
        build.library("broken", [])
    with pytest.raises(build.KernelError, match="unavailable"):   # and on every later call
        build.library("broken", [])


def test_the_compiler_and_its_version_are_in_the_cache_key(monkeypatch, tmp_path):
    paths = []
    for version in ("1", "2"):
        cc = _script(tmp_path / f"cc{version}", f'if [ "$1" = --version ]; then echo "cc {version}"; exit 0; fi\n'
                                                'exec cc "$@"\n')
        monkeypatch.setenv("CC", cc)
        monkeypatch.setattr(build, "_libs", {})
        assert build.library("keyed", []) is not None
        paths.append(_files(build.cache_dir()))
    assert paths[0] == [".so"] and paths[1] == [".so", ".so"]


def test_an_instruction_set_the_cpu_has_but_the_build_lacks(monkeypatch, tmp_path, caplog):
    """A compiler that leaves out an ISA the CPU has: logged under auto (the library still loads,
    without those kernels), an error under required. An ISA the CPU lacks is not missing."""
    if "avx2" not in build.cpu_flags():
        pytest.skip("the CPU has no AVX2 to leave out")
    cc = _script(tmp_path / "oldcc", 'exec cc "$@" -mno-avx2\n')
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.WARNING, logger="stagewise.kernels"):
        assert build.library("old", []) is not None
    assert "without avx2" in caplog.text
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setenv("STAGEWISE_KERNELS", "required")
    with pytest.raises(build.KernelError, match="without avx2"):
        build.library("old", [])
    monkeypatch.setenv("CC", "cc")
    assert build.library("current", []) is not None            # the real compiler misses nothing


@pytest.mark.parametrize("isa,has", [("avx2", {"avx2", "fma", "f16c"}), ("portable", set())])
def test_a_forced_build_is_what_that_cpu_would_build(monkeypatch, isa, has):
    """`STAGEWISE_KERNEL_ISA` builds (and caches apart) the library of a CPU with no more than that
    instruction set, and `cpu_flags()` reports what such a CPU has; the native build is unchanged."""
    if build.isa_runs_here(isa):
        pytest.skip(f"this machine cannot run the {isa} build: {build.isa_runs_here(isa)}")
    native = build.library("forced", [])
    monkeypatch.setenv("STAGEWISE_KERNEL_ISA", isa)
    lib = build.library("forced", [])
    assert lib is not None and build.isa_of(lib) == has
    assert not {f for f in build.cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni"))}
    assert ({"avx2", "fma", "f16c"} & build.cpu_flags()) == has and not build.native_bf16()
    assert len(list(build.cache_dir().glob("forced_*.so"))) == 2 and native is not lib
    monkeypatch.setenv("STAGEWISE_KERNEL_ISA", "native")
    assert build.library("forced", []) is native and build.cpu_flags() == build.machine_flags()


def test_a_build_the_cpu_cannot_run_is_one_line(monkeypatch, caplog):
    monkeypatch.setattr(build, "machine_flags", lambda: frozenset({"sse2"}))
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("STAGEWISE_KERNEL_ISA", "avx2")
    with caplog.at_level(logging.WARNING, logger="stagewise.kernels"):
        assert build.library("cannot", []) is None
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "CPU kernels unavailable: STAGEWISE_KERNEL_ISA=avx2 cannot run here: this CPU lacks avx2, fma, f16c"]
    monkeypatch.setattr(build, "_libs", {})
    monkeypatch.setenv("STAGEWISE_KERNELS", "required")
    with pytest.raises(build.KernelError, match="this CPU lacks avx2, fma, f16c"):
        build.library("cannot", [])


def test_a_bad_isa_is_one_sentence(monkeypatch):
    monkeypatch.setenv("STAGEWISE_KERNEL_ISA", "avx9")
    with pytest.raises(ValueError, match="STAGEWISE_KERNEL_ISA must be one of native, avx2, portable, got 'avx9'"):
        build.library("bad", [])
