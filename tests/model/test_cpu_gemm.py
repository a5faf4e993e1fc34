"""The small-row CPU linear kernel against `F.linear`: every row count the tiles cover (full and
partial weight tiles, blocks of four rows), biases, bf16 weights, strided activation rows, batch invariance, and
the dispatch that keeps MKL from `MAX_ROWS` rows up and for what the kernel does not serve."""
import pytest
import torch
import torch.nn.functional as F

from stagewise.model import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler for the CPU kernel")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("n,k", [(960, 576), (1001, 64), (5, 8), (7, 136)])
def test_kernel_equals_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for bias in (None, b):
        got, ref = cpu_gemm.small_linear(x, w, bias), F.linear(x, w, bias)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4 * k ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 5, 6, 9, 17])
def test_bf16_multiplies_exact_products_in_float32(rows):
    """bf16 weights widened in registers, or (with AVX512-BF16) bf16 pairs multiplied natively:
    exact products, float32 sums, one rounding; partial weight tiles (77 rows) included."""
    gen = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((rows, 192), (77, 192), (77,)))
    got = cpu_gemm.small_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float(), b.float())          # exact products, fp32 sums, one rounding
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=1e-2)
    alone = torch.cat([cpu_gemm.small_linear(x[i:i + 1], w, b) for i in range(rows)])
    assert torch.equal(got, alone)                           # batch invariant, as in float32


def test_bf16_dispatch_by_rows(monkeypatch):
    calls = []
    real = cpu_gemm.small_linear
    monkeypatch.setattr(cpu_gemm, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(40, 64).bfloat16()
    limit = cpu_gemm._max_rows(torch.bfloat16)
    assert limit == (min(cpu_gemm.MAX_ROWS, cpu_gemm.NATIVE_BF16_ROWS) if cpu_gemm.NATIVE_BF16 else cpu_gemm.MAX_ROWS)
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(cpu_gemm.linear(x, w).float(), F.linear(x.float(), w.float()), atol=0.05, rtol=1e-2)
    assert calls == [1, limit]
    if cpu_gemm.NATIVE_BF16:                 # native bf16 pairs need K % 32: other K go to oneDNN
        assert not cpu_gemm.supports(torch.randn(2, 48).bfloat16(), torch.randn(8, 48).bfloat16(), None)


def test_strided_rows_and_empty():
    gen = torch.Generator().manual_seed(1)
    wide, w = torch.randn(6, 256, generator=gen), torch.randn(40, 128, generator=gen)
    x = wide[:, 64:192]                                    # row stride 256, unit column stride
    torch.testing.assert_close(cpu_gemm.small_linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert cpu_gemm.small_linear(torch.empty(0, 128), w).shape == (0, 40)


def test_a_rows_result_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 576, generator=gen), torch.randn(300, 576, generator=gen)
    alone = torch.cat([cpu_gemm.small_linear(x[i:i + 1], w) for i in range(11)])
    for m in (2, 3, 4, 5, 11):
        assert torch.equal(cpu_gemm.small_linear(x[:m], w), alone[:m])


def test_dispatch(monkeypatch):
    calls = []
    real = cpu_gemm.small_linear
    monkeypatch.setattr(cpu_gemm, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(24, 64)
    for rows in (1, cpu_gemm.MAX_ROWS, cpu_gemm.MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(cpu_gemm.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert calls == [1, cpu_gemm.MAX_ROWS]                  # MKL from MAX_ROWS + 1 rows
    cpu_gemm.linear(torch.randn(2, 64, dtype=torch.float64), w.double())    # other dtypes: F.linear
    cpu_gemm.linear(torch.randn(2, 60), torch.randn(24, 60))                # K not a multiple of 8
    cpu_gemm.linear(torch.randn(2, 64), w.t().contiguous().t())             # a transposed weight
    assert calls == [1, cpu_gemm.MAX_ROWS]


def test_the_compiled_op_picks_by_rows_at_run_time():
    """Under torch.compile with a dynamic row dimension the call is the opaque op, and it matches
    F.linear on both sides of the crossover from one compiled graph."""
    lin = cpu_gemm.Linear(64, 48, bias=True).requires_grad_(False)     # the engine never trains
    fn = torch.compile(lambda x: torch.relu(lin(x)), dynamic=True, fullgraph=True)
    for rows in (3, cpu_gemm.MAX_ROWS + 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(fn(x), torch.relu(F.linear(x, lin.weight, lin.bias)), atol=1e-4, rtol=1e-4)
