"""The C++ registration of the kernel ops (csrc/*_ops.cpp): active wherever the C kernels are,
bit for bit the Python registration's results (both call the same C kernels), the same argument
checks, and where it cannot be built the Python registration serves, after one log line (an error
under STAGEWISE_KERNELS=required)."""
import os
import subprocess
import sys

import pytest
import torch

from stagewise.kernels import attention, build, gemm, native

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")
needs_native_bf16 = pytest.mark.skipif(not build.native_bf16(), reason="needs native bf16 (AVX512-BF16)")
ops = torch.ops.stagewise


def test_the_cpp_kernels_are_registered():
    assert gemm.available() and attention.available()
    if build.cxx_compiler() is None and build.mode() == "auto":
        pytest.skip("no C++ compiler: the Python registration serves (tested below)")
    assert native.loaded("gemm") and native.loaded("attention")
    for op in ("linear", "linear_packed", "decode_attention", "rows_attention", "prefill_attention"):
        assert "_ops.cpp" in torch._C._dispatch_dump(f"stagewise::{op}").split("\nCPU: ")[1].splitlines()[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_the_python_registration(dtype):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 64, generator=gen).to(dtype), torch.randn(40, generator=gen).to(dtype)
    limit = gemm._max_rows(dtype)
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        for bias in (None, b):
            assert torch.equal(ops.linear(x, w, bias), gemm._by_rows(x, w, bias))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_native_bf16)])
def test_linear_packed_equals_the_python_registration(dtype):
    gen = torch.Generator().manual_seed(1)
    n = 2 * gemm.layout(dtype)[0] + (16 if dtype == torch.bfloat16 else gemm.layout(dtype)[0] // 2)
    w = gemm.pack(torch.randn(n, 64, generator=gen).to(dtype))
    b = torch.randn(n, generator=gen).to(dtype)
    for rows in (0, 1, 7, 50):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        for args in ((x, w, None, False), (x, w, b, False), (x, w, b, True), (x.double(), w, b, False)):
            assert torch.equal(ops.linear_packed(*args), gemm._packed(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 24])
def test_decode_attention_equals_the_python_registration(dtype, d):
    gen = torch.Generator().manual_seed(d)
    cache = torch.randn(2, 12, 4, 2, d, generator=gen).to(dtype)
    q = torch.randn(3, 6, 2 * d, generator=gen).to(dtype)[:, :, :d]       # rows of another stride
    tables, lens = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 0, 0]]), torch.tensor([11, 8, 1])
    for per_sequence in (None, True, False):
        args = (q, cache, tables, lens, 0.3, per_sequence)
        assert torch.equal(ops.decode_attention(*args), attention._decode(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 24])
def test_rows_attention_equals_the_python_registration(dtype, d):
    gen = torch.Generator().manual_seed(d + 1)
    cache = torch.randn(2, 12, 4, 2, d, generator=gen).to(dtype)
    q = torch.randn(6, 6, 2 * d, generator=gen).to(dtype)[:, :, :d]       # rows of another stride
    tables, lens = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([9, 10, 11, 5, 6, 7])
    args = (q, cache, tables, torch.tensor([0, 3, 6]), lens, 0.3)
    assert torch.equal(ops.rows_attention(*args), attention._rows(*args))


@pytest.mark.parametrize("call", [ops.rows_attention, attention._rows])
def test_both_registrations_check_spans(call):
    cache, q, tables = torch.randn(2, 6, 4, 2, 16), torch.randn(3, 4, 16), torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="span 0 of 1 .* reads blocks outside 0..5"):
        call(q, cache, torch.tensor([[1, 2, 6]]), torch.tensor([0, 3]), torch.tensor([7, 8, 9]), 0.3)
    with pytest.raises(ValueError, match="span 0 of 1 .* has a row length outside 1..12"):
        call(q, cache, tables, torch.tensor([0, 3]), torch.tensor([7, 8, 13]), 0.3)
    with pytest.raises(ValueError, match="spans must be int64 \\[S \\+ 1\\]"):
        call(q, cache, tables, torch.tensor([0, 1, 3]), torch.tensor([7, 8, 9]), 0.3)
    with pytest.raises(ValueError, match="span_tables must be int64"):
        call(q, cache, tables.int(), torch.tensor([0, 3]), torch.tensor([7, 8, 9]), 0.3)
    with pytest.raises(ValueError, match="seq_lens must be int64"):
        call(q, cache, tables, torch.tensor([0, 3]), torch.tensor([7, 8]), 0.3)


@needs_native_bf16
def test_prefill_attention_equals_the_python_registration():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(37, h, 32, generator=gen).bfloat16() for h in (4, 2, 2))
    assert torch.equal(ops.prefill_attention(q, k, v, 0.2), attention._prefill(q, k, v, 0.2))


@pytest.mark.parametrize("call", [ops.decode_attention, attention._decode])
def test_both_registrations_check_the_tables(call):
    cache = torch.randn(2, 6, 4, 2, 16)
    args = dict(q=torch.randn(2, 4, 16), kv_cache=cache, seq_lens=torch.tensor([5, 8]), scale=0.25)
    with pytest.raises(ValueError, match=r"sequence 1 reads blocks \[3, 6\], but the cache holds blocks 0..5"):
        call(block_tables=torch.tensor([[1, 2], [3, 6]]), **args)
    with pytest.raises(ValueError, match="sequence 0 has 5 keys, but its block table row holds 1 blocks of 4"):
        call(block_tables=torch.tensor([[1], [3]]), **args)
    with pytest.raises(ValueError, match="block_tables must be int64"):
        call(block_tables=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), **args)


@pytest.mark.parametrize("call", [ops.prefill_attention, attention._prefill])
def test_both_registrations_check_prefill_arguments(call):
    with pytest.raises(ValueError, match="stagewise prefill attention"):
        call(torch.randn(5, 4, 16).bfloat16(), torch.randn(4, 2, 16).bfloat16(), torch.randn(4, 2, 16).bfloat16(), 0.2)


def test_both_registrations_check_small_linear_arguments():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    for call in (ops.linear, gemm._by_rows):
        with pytest.raises(ValueError, match="stagewise linear kernel: x"):
            call(x, w, torch.randn(9))


PROBE = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from stagewise.kernels import gemm, native
w = gemm.pack(torch.randn(2 * gemm.layout(torch.float32)[0], 64))
x = torch.randn(3, 64)
assert torch.equal(torch.ops.stagewise.linear_packed(x, w, None), gemm._packed(x, w, None))
print("native", native.loaded("gemm"))
"""


@pytest.mark.slow
def test_without_a_cxx_compiler_the_python_registration_serves(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent/g++", "STAGEWISE_CACHE": str(tmp_path), "STAGEWISE_KERNELS": "auto"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "native False"
    lines = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(lines) == 1 and "C++ op registration unavailable: no C++ compiler" in lines[0], out.stderr
    env["STAGEWISE_KERNELS"] = "required"
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0 and "KernelError: C++ op registration unavailable" in out.stderr
