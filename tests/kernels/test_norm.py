"""The fused (residual add +) RMSNorm kernel (csrc/norm.c) against the PyTorch path of
model/layers.py `RMSNorm` (HF's rounding points), in every build: the same bits, as it sums squares
in PyTorch's order (within a tolerance for rows PyTorch sums over several threads); rows
independent of the batch; bad arguments refused with a ValueError; RMSNorm in eager mode using it."""

import pytest
import torch
import torch.nn.functional as F

from stagewise.kernels import build, native
from stagewise.kernels import norm as cpu_norm
from stagewise.model.layers import RMSNorm

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")

EPS = 1e-5
WIDTHS = [1, 7, 8, 15, 16, 37, 64, 576, 1000]
BUILDS = {"avx512": ("-mno-avx512bf16",), "avx2": ("-mno-avx512f",),
          "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def _reference(x, residual, weight):
    """model/layers.py RMSNorm's PyTorch path."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, EPS), x
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).to(x.dtype), x


def _inputs(m, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(m, n, generator=gen).mul(3).to(dtype) for _ in range(2))
    w = (torch.randn(n, generator=gen) * 0.5 + 1).to(dtype)
    return x, r, w


def _assert_same(got, ref):
    assert got.dtype == ref.dtype and torch.equal(got, ref), (got.float() - ref.float()).abs().max()


def _assert_close(got, ref):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        return
    ulps = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert ulps.max() <= 1, ulps.max()
    assert (ulps > 0).float().mean() <= 1e-3           # identical in the vast majority


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m", [1, 3, 33])
def test_kernel_matches_the_pytorch_path(dtype, with_residual, m):
    for n in WIDTHS:
        x, r, w = _inputs(m, n, dtype, seed=n)
        residual = r if with_residual else None
        out, total = cpu_norm.rms_norm(x, residual, w, EPS)
        ref, ref_total = _reference(x, residual, w)
        _assert_same(out, ref)
        if with_residual:
            assert torch.equal(total, ref_total)       # one rounding of the sum, as x + residual
        else:
            assert total.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_single_rows_stay_close(dtype):
    """PyTorch sums one row of 32768 values or more over several threads: there the kernel's
    results are within float32 rounding of PyTorch's (bf16: at most 1 ulp, and rarely)."""
    x, r, w = _inputs(1, 40000, dtype)
    for residual in (None, r):
        out, _ = cpu_norm.rms_norm(x, residual, w, EPS)
        _assert_close(out, _reference(x, residual, w)[0])


def test_row_strides_and_both_registrations():
    """Rows with a stride (a slice of a wider tensor); the C++ op and the Python one agree."""
    for dtype in (torch.float32, torch.bfloat16):
        x, r, w = _inputs(9, 100, dtype)
        wide = torch.randn(9, 300).to(dtype)
        wide[:, 50:150] = x
        xs = wide[:, 50:150]
        got = cpu_norm._rms_norm(xs, r, w, EPS)
        assert torch.equal(got[0], cpu_norm._rms_norm(x, r, w, EPS)[0])
        if native.loaded("norm"):
            op = torch.ops.stagewise.rms_norm(xs, r, w, EPS)
            assert torch.equal(op[0], got[0]) and torch.equal(op[1], got[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch(dtype):
    """A row gives the same bits alone, in any batch and at any position (also past the team's
    threshold, where rows split over threads)."""
    x, r, w = _inputs(300, 576, dtype)
    big = cpu_norm.rms_norm(x, r, w, EPS)
    for i in (0, 7, 8, 299):
        alone = cpu_norm.rms_norm(x[i:i + 1], r[i:i + 1], w, EPS)
        assert torch.equal(alone[0][0], big[0][i]) and torch.equal(alone[1][0], big[1][i])
    part = cpu_norm.rms_norm(x[5:50], r[5:50], w, EPS)
    assert torch.equal(part[0], big[0][5:50])


def _build(name):
    flags = BUILDS[name]
    if name == "avx512" and "avx512f" not in build.cpu_flags():
        pytest.skip("the CPU has no AVX-512")
    if name == "avx2" and not {"avx2", "fma"} <= build.cpu_flags():
        pytest.skip("the CPU has no AVX2")
    lib = build.library("norm", ["norm.c"], flags)
    assert lib is not None
    cpu_norm.bind(lib)
    lib.norm_set_lanes(cpu_norm.torch_lanes(lib))
    return lib


def _run(lib, x, residual, w):
    m, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x)
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    fn(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), n, w.data_ptr(),
       out.data_ptr(), n, None if residual is None else total.data_ptr(), n, m, n, EPS)
    return out, total


@pytest.mark.parametrize("isa", list(BUILDS))
def test_every_build_gives_the_same_bits(isa):
    """AVX-512, AVX2 and portable builds: each gives PyTorch's bits (one summation order in all)."""
    lib = _build(isa)
    expected = {"avx512": {"avx512f"}, "avx2": {"avx2"}, "portable": set()}[isa]
    assert expected <= build.isa_of(lib) and ("avx512f" in build.isa_of(lib)) == (isa == "avx512")
    assert isa != "portable" or "avx2" not in build.isa_of(lib)
    for dtype in (torch.float32, torch.bfloat16):
        for n in WIDTHS:
            x, r, w = _inputs(5, n, dtype, seed=n + 1)
            for residual in (None, r):
                got, total = _run(lib, x, residual, w)
                ref, ref_total = _reference(x, residual, w)
                _assert_same(got, ref)
                if residual is not None:
                    assert torch.equal(total, ref_total)
                default = cpu_norm._rms_norm(x, residual, w, EPS)[0]
                assert torch.equal(got, default), (isa, dtype, n)


@pytest.mark.parametrize("registration", ["python", "op"])
def test_bad_arguments_are_refused(registration):
    if registration == "op" and not (cpu_norm.available() and native.loaded("norm")):
        pytest.skip("the C++ registration did not build")
    call = cpu_norm._rms_norm if registration == "python" else torch.ops.stagewise.rms_norm
    x, r, w = _inputs(4, 64, torch.float32)
    bad = [
        (x.double(), None, w.double()),          # dtype
        (x.half(), None, w.half()),
        (x, None, w.bfloat16()),                 # weight dtype
        (x, None, w[:63]),                       # weight size
        (x, None, torch.ones(2, 64)),            # weight shape
        (x, r[:3], w),                           # residual rows
        (x, r.bfloat16(), w),                    # residual dtype
        (x.t(), None, torch.ones(4)),            # rows not contiguous
        (x, r.t().contiguous().t(), w),          # residual rows not contiguous
        (x[None], None, w),                      # not 2-D
        (x, None, torch.ones(128)[::2]),         # weight not contiguous
    ]
    for args in bad:
        with pytest.raises(ValueError, match="stagewise rms_norm: .*it needs CPU float32 or bfloat16"):
            call(*args, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_layer_uses_the_kernel_in_eager_mode(dtype, monkeypatch):
    """RMSNorm's eager path (2-D rows with residual, [T, H, D] heads of a fused projection) against
    its PyTorch path; with the kernel unavailable it runs PyTorch's ops."""
    layer = RMSNorm(64, EPS, dtype)
    layer.weight.data = (torch.randn(64) * 0.5 + 1).to(dtype)
    x, r, _ = _inputs(6, 64, dtype)
    qkv = torch.randn(5, 6 * 64).to(dtype)
    heads = qkv[:, :3 * 64].view(5, 3, 64)
    calls = []
    real = cpu_norm.rms_norm
    monkeypatch.setattr(cpu_norm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out, total = layer(x, r)
        out3 = layer(heads)
        assert len(calls) == 2
        monkeypatch.setattr(cpu_norm, "available", lambda: False)
        ref, ref_total = layer(x, r)
        ref3 = layer(heads)
    assert len(calls) == 2
    _assert_same(out, ref)
    assert torch.equal(total, ref_total)
    assert out3.shape == heads.shape
    _assert_same(out3, ref3)


def test_the_op_runs_the_cpp_registration():
    """Wherever the C kernel builds (and a C++ compiler exists), the op's CPU kernel is norm_ops.cpp's."""
    if build.cxx_compiler() is None:
        pytest.skip("no C++ compiler")
    assert cpu_norm.available() and native.loaded("norm")
    dump = torch._C._dispatch_dump("stagewise::rms_norm")
    assert "norm_ops.cpp" in dump.split("\nCPU: ")[1].splitlines()[0]
