"""The quantized linear kernels against `F.linear` on the dequantized weight, for every type, every
instruction-set build this CPU runs (AVX-512 with and without VNNI, AVX2, portable C) and the row
counts a step uses; batch invariance; and the checks at the kernels' boundary.

Tolerances, from the arithmetic: exact mode sums fp32 products of the exactly dequantized weights,
so it is within the fp32 dot-product bound K * 2^-24 * sum|x||w| of the float64 product. Fast mode
rounds each activation to x' = d * q with d = max|x| / 127 per 32 (|x - x'| <= d / 2), then sums
exactly in integers: so it is within sum_chunks d/2 * sum|w| of the true product, and within fp32
rounding of the same computation done in float64 on x' (`_fast_oracle`)."""
import ctypes
import mmap

import numpy as np
import pytest
import torch
from quant_blocks import TYPES, random_blocks

from stagewise.kernels import quant, quant_kernels, quant_pack
from stagewise.kernels.quant import QuantizedWeight, T
from stagewise.kernels.quant_formats import K_TYPES

VARIANTS = [v for v in quant_kernels.VARIANTS if quant_kernels.variant_runs_here(v)]
ROWS = [1, 2, 3, 4, 7, 8, 16, 32, 33, 64, 200, 512]


def _weight(qtype, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight.from_gguf(random_blocks(qtype, n, k, gen), qtype, (n, k)).pack()


def _activations(x):
    """The kernels' activation rounding, in float64: per 32, d = max|x| / 127, q = round-half-even(x / d)."""
    chunks = x.double().reshape(x.shape[0], -1, 32)
    amax = chunks.abs().amax(-1, keepdim=True).float().double()
    d = (amax.float() / 127).double()
    inverse = torch.where(amax > 0, (127 / amax.float()).double(), 0.0)
    q = torch.round((chunks.float() * inverse.float()).double())
    return (q * d).reshape(x.shape), d.reshape(x.shape[0], -1)


def _fast_oracle(x, w64):
    return _activations(x)[0] @ w64.T


def _fast_bound(x, w64):
    """sum over chunks of d/2 * sum |w|: the activation rounding's worst effect on each output."""
    d = _activations(x)[1]
    return (d / 2) @ w64.abs().reshape(w64.shape[0], -1, 32).sum(-1).T


def _fp32_bound(x, w64, k):
    return k * 2.0 ** -24 * (x.double().abs() @ w64.abs().T) + 1e-30


def _check(qtype, n, k, rows, variant, seed=0):
    w = _weight(qtype, n, k, seed)
    w64 = quant.dequantize(w).double()
    gen = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, k, generator=gen)
    exact = quant_kernels.run_linear(x, w.data, None, int(qtype), n, True, False, variant).double()
    assert ((exact - x.double() @ w64.T).abs() <= _fp32_bound(x, w64, k)).all()
    fast = quant_kernels.run_linear(x, w.data, None, int(qtype), n, False, False, variant).double()
    oracle = _fast_oracle(x, w64)
    assert ((fast - oracle).abs() <= _fp32_bound(_activations(x)[0], w64, k) * 4).all()
    assert ((fast - x.double() @ w64.T).abs() <= _fast_bound(x, w64) + _fp32_bound(x, w64, k) * 4).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_native_kernel_every_row_count(qtype, rows):
    """300 outputs: 20 panels, so one- and two-row steps use their wide tiles and a narrower rest"""
    _check(qtype, 300, 512, rows, "native")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k,rows", [(1, 256, 1), (300, 256, 1), (200, 256, 2), (37, 768, 5), (64, 256, 13),
                                      (100, 256, 200)])
def test_every_build_odd_shapes(variant, qtype, n, k, rows):
    """300 outputs at one row and 200 at two: the decode tiles (8 and 4 panels on AVX-512 and AVX2)
    and a narrower rest"""
    _check(qtype, n, k, rows, variant, seed=n + k)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_blocks_of_32_take_any_k(qtype):
    _check(qtype, 40, 96, 9, "native")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("exact", [False, True])
def test_batch_invariance(variant, exact):
    """A row's output is bit-identical alone, in any batch, whatever tiles run it (wide decode
    tiles at one and two rows, direct ones up to 6, blocked ones above), on one or two threads."""
    w = _weight(T.Q4_K, 300, 512)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(2))
    run = lambda rows: quant_kernels.run_linear(rows, w.data, None, int(T.Q4_K), 300, exact, False, variant)
    full = run(x)
    for i in (0, 5, 36):
        assert torch.equal(run(x[i:i + 1]), full[i:i + 1])
    for lo, hi in ((3, 5), (3, 9), (3, 10)):
        assert torch.equal(run(x[lo:hi]), full[lo:hi])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(run(x), full)
    finally:
        torch.set_num_threads(threads)


def _at_page_end(data):
    """A copy of `data` whose last byte is the last of a page followed by an unreadable one (a read
    past the matrix faults), and the mapping that holds it."""
    page = mmap.PAGESIZE
    size = (data.numel() + page - 1) // page * page
    area = mmap.mmap(-1, size + page)
    buf = torch.frombuffer(area, dtype=torch.uint8)
    assert ctypes.CDLL(None).mprotect(ctypes.c_void_p(buf.data_ptr() + size), ctypes.c_size_t(page), 0) == 0
    copy = buf[size - data.numel():size].view(data.shape)
    copy.copy_(data)
    return copy, area


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_exact_decode_tiles_match_batches(variant, qtype):
    """Exact mode: steps of a few rows (weights dequantized in registers, 4- and 8-bit codes read in
    place: decode and verify steps) give the bits of the same rows in a batch of 40 (panels
    dequantized into memory once for all rows); 350 outputs leave a narrower last group of panels,
    and the matrix ends where memory stops being readable: nothing is read past it."""
    n, k = 350, 512 if qtype in K_TYPES else 288
    w = _weight(qtype, n, k, 5)
    data, area = _at_page_end(w.data)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    run = lambda rows: quant_kernels.run_linear(rows, data, None, int(qtype), n, True, True, variant)
    full = run(x)
    assert torch.equal(full, quant_kernels.run_linear(x, w.data, None, int(qtype), n, True, True, variant))
    for lo, hi in ((0, 1), (39, 40), (2, 4), (5, 12), (3, 10), (8, 20), (4, 36)):
        assert torch.equal(run(x[lo:hi]), full[lo:hi]), (lo, hi)


# builds of one vector width, with and without VNNI, where this CPU runs both
_VNNI_PAIRS = [p for p in (("avx512", "native"), ("avx2", "avx2-vnni")) if set(p) <= set(VARIANTS)]


@pytest.mark.parametrize("plain,vnni", _VNNI_PAIRS)
def test_vnni_gives_the_same_bits(plain, vnni):
    """The integer sums are exact, so vpdpbusd (Q8_0 codes kept unsigned) and maddubs + madd (signed,
    sign trick) give the same bits, for every type and the decode, direct and blocked tiles."""
    if quant_kernels.library(plain).quant_isa() != quant_kernels.library(vnni).quant_isa():
        pytest.skip(f"the {vnni} build is not the {plain} build's width on this CPU")
    for qtype in TYPES:
        w = _weight(qtype, 100, 512, 7)
        for rows in (1, 2, 5, 13):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            a, b = (quant_kernels.run_linear(x, w.data, None, int(qtype), 100, False, True, v) for v in (plain, vnni))
            assert torch.equal(a, b), (qtype.name, rows)


@pytest.mark.parametrize("exact", [False, True])
def test_dtypes_and_bias(exact):
    w = _weight(T.Q6_K, 50, 256)
    gen = torch.Generator().manual_seed(3)
    x, b = torch.randn(6, 256, generator=gen).bfloat16(), torch.randn(50, generator=gen)
    run = lambda *a: quant_kernels.run_linear(*a)
    f32 = run(x.float(), w.data, b, int(T.Q6_K), 50, exact, True)
    assert torch.equal(run(x, w.data, b, int(T.Q6_K), 50, exact, True), f32)          # bf16 rows read exactly
    assert torch.equal(run(x, w.data, b, int(T.Q6_K), 50, exact, False), f32.bfloat16())  # one rounding
    unbiased = run(x.float(), w.data, None, int(T.Q6_K), 50, exact, True)
    torch.testing.assert_close(f32, unbiased + b, rtol=0, atol=1e-5 * f32.abs().max().item())
    assert run(x[:0], w.data, b, int(T.Q6_K), 50, exact, False).shape == (0, 50)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_kernel(variant, qtype):
    w = _weight(qtype, 40, 256)
    ids = torch.tensor([39, 0, 17, 17, 33])
    ref = quant.dequantize(w)[ids]
    assert torch.equal(quant_kernels.run_dequant_rows(w.data, int(qtype), 40, 256, ids, torch.float32, variant), ref)
    got = quant_kernels.run_dequant_rows(w.data, int(qtype), 40, 256, ids, torch.bfloat16, variant)
    assert torch.equal(got, ref.bfloat16())
    with pytest.raises(IndexError, match="Row ids"):
        quant_kernels.run_dequant_rows(w.data, int(qtype), 40, 256, torch.tensor([40]), torch.float32, variant)


@pytest.mark.parametrize("problem,args", [
    ("contiguous uint8", dict(k=512)), ("contiguous uint8", dict(n=80)), ("contiguous uint8", dict(n=8)),
    ("contiguous uint8", dict(data="strided")), ("contiguous uint8", dict(data="meta")),
    ("multiple of 256", dict(k=200)), ("no quantized kernel", dict(qtype=int(T.F16))), ("N >= 0", dict(n=-1)),
    ("integers", dict(ids=torch.tensor([1.0])))])
def test_dequantize_rows_refuses(problem, args):
    """A matrix whose sizes do not match its bytes is refused before the C reads it (a K or N larger
    than the data would read past it)."""
    w = _weight(T.Q4_K, 40, 256)
    data = {"strided": w.data.T.contiguous().T, "meta": w.data.to("meta")}.get(args.pop("data", ""), w.data)
    call = dict(data=data, qtype=int(T.Q4_K), n=40, k=256, ids=torch.tensor([0, 39]), dtype=torch.float32) | args
    with pytest.raises(ValueError, match=problem):
        quant_kernels.run_dequant_rows(**call)


def test_layout_sizes_agree():
    lib = quant_kernels.library()
    for qtype in TYPES:
        for k in (256, 2048):
            assert lib.quant_panel_bytes(int(qtype), ctypes.c_int64(k)) == quant_pack.panel_bytes(qtype, k)


def test_linear_dispatch():
    """`quant.linear` runs the kernel on packed weights and the dequantizing reference on file rows."""
    w = _weight(T.Q5_0, 37, 256)
    rows = QuantizedWeight.from_gguf(random_blocks(T.Q5_0, 37, 256, torch.Generator().manual_seed(0)), T.Q5_0,
                                     (37, 256))
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4))
    got = quant.linear(x, w, exact=True)
    assert got.shape == (2, 3, 37)
    torch.testing.assert_close(got, quant.linear(x, rows, exact=True), rtol=1e-5, atol=1e-5)
    assert torch.equal(quant.linear(x, w), quant_kernels.run_linear(x.reshape(6, 256), w.data, None, int(T.Q5_0),
                                                                    37, False, False).view(2, 3, 37))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, 130])
def test_linear_cat_equals_parts(exact, rows):
    """Weights side by side in one call (mixed types, odd row counts): each part's columns equal its
    own call, bit for bit, and the bias lands on the right columns."""
    parts = [_weight(T.Q4_K, 40, 256, 1), _weight(T.Q6_K, 17, 256, 2), _weight(T.Q8_0, 64, 256, 3)]
    gen = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 256, generator=gen).bfloat16(), torch.randn(121, generator=gen)
    got = quant.linear_cat(x.unsqueeze(0), parts, b, exact=exact, f32_out=True)[0]
    alone = torch.cat([quant.linear(x, w, exact=exact, f32_out=True) for w in parts], -1)
    assert torch.equal(got, alone + b)                        # the same float32 add, in C or here
    assert torch.equal(quant.linear_cat(x, parts, exact=exact, f32_out=True), alone)
    with pytest.raises(ValueError, match="1 to 8 weights"):
        quant_kernels.run_linear_cat(x, [], None, [], [], exact, False)
    with pytest.raises(ValueError, match="bias"):
        quant.linear_cat(x, parts, b[:-1])


_CALLERS = {"python": lambda x, data, bias, qtype, n: quant_kernels.run_linear(x, data, bias, qtype, n, False, False),
            "op": lambda x, data, bias, qtype, n: torch.ops.stagewise.qlinear(x, data, bias, qtype, n, True, False,
                                                                              False)}


@pytest.mark.parametrize("caller", _CALLERS)
def test_boundary_checks(caller):
    """The Python checks and the op's (registered from C++ where it built) refuse the same calls."""
    w = _weight(T.Q4_0, 40, 256)
    x, b = torch.randn(3, 256), torch.randn(40)
    run = _CALLERS[caller]
    call = lambda x=x, data=w.data, bias=None, n=40, qtype=int(T.Q4_0): run(x, data, bias, qtype, n)
    cases = [("float32 or bfloat16", dict(x=x.double())), ("float32 or bfloat16", dict(x=x[0])),
             ("must match the weight", dict(x=torch.randn(3, 512))), ("multiple of 32", dict(x=torch.randn(3, 250))),
             ("unit column stride", dict(x=torch.randn(256, 3).T)), ("contiguous uint8", dict(data=w.data[:, :-1])),
             ("contiguous uint8", dict(data=w.data.T.contiguous().T)),
             ("contiguous uint8", dict(data=w.data.view(torch.int8))), ("contiguous uint8", dict(n=70)),
             ("bias", dict(bias=torch.randn(39))), ("N >= 0", dict(n=-5)),
             ("no quantized kernel", dict(qtype=int(T.IQ4_NL)))]
    if caller == "python":      # the dispatcher sends an op call with a meta tensor to its fake: no read
        cases += [("contiguous uint8", dict(data=w.data.to("meta"))), ("bias", dict(bias=b.to("meta")))]
    for problem, args in cases:
        with pytest.raises(ValueError, match=problem):
            call(**args)
    assert torch.equal(call(), quant_kernels.run_linear(x, w.data, None, int(T.Q4_0), 40, False, False))


def test_op_refuses_file_rows_and_bad_lists():
    rows = QuantizedWeight.from_gguf(random_blocks(T.Q4_0, 40, 256, torch.Generator().manual_seed(0)), T.Q4_0,
                                     (40, 256))
    x = torch.randn(2, 256)
    if quant_kernels.native_ops():
        with pytest.raises(ValueError, match="pack"):
            torch.ops.stagewise.qlinear(x, rows.data, None, int(T.Q4_0), 40, False, False, False)
    torch.testing.assert_close(quant.linear(x, rows), x @ quant.dequantize(rows).T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="1 to 8 weights"):
        torch.ops.stagewise.qlinear_cat(x, [rows.pack().data], None, [int(T.Q4_0)], [40, 2], False, False)
    with pytest.raises(ValueError, match="features"):
        quant.linear(torch.randn(2, 128), rows)


@pytest.mark.slow
def test_compiled_call_is_one_op():
    """Under torch.compile the quantized linear is the opaque op and gives the eager result."""
    w = _weight(T.Q8_0, 64, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    fn = lambda x, data: torch.ops.stagewise.qlinear(x, data, None, int(T.Q8_0), 64, True, False, False)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, w.data), quant.linear(x, w))
    assert torch.equal(compiled(x[:2], w.data), quant.linear(x[:2], w))


@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp4_every_scale_and_code(variant):
    """MXFP4's E8M0 scales over their whole range (2^-128 and 2^-127 subnormal, up to 2^127: fp16
    would hold few of them) with every code: the kernels' values are gguf-py's bit for bit, read back
    by the row kernel and by exact mode on one-hot rows (decode, few-row and many-row tiles)."""
    from gguf.quants import dequantize as gguf_dequantize
    n, k = 32, 256
    data = random_blocks(T.MXFP4, n, k, torch.Generator().manual_seed(9))
    data.view(n, k // 32, 17)[..., 0] = torch.arange(n * k // 32, dtype=torch.uint8).view(n, k // 32)
    with np.errstate(over="ignore"):       # the largest scales times 6 overflow to inf, in both
        want = torch.from_numpy(gguf_dequantize(data.numpy(), T.MXFP4)).reshape(n, k)
    w = QuantizedWeight.from_gguf(data, T.MXFP4, (n, k)).pack()
    got = quant_kernels.run_dequant_rows(w.data, int(T.MXFP4), n, k, torch.arange(n), torch.float32, variant)
    assert torch.equal(got, want)
    finite = want.isfinite().all(1)
    eye = torch.eye(k)
    for rows in (eye[7:8], eye[100:103], eye):
        y = quant_kernels.run_linear(rows, w.data, None, int(T.MXFP4), n, True, True, variant)
        cols = rows.argmax(1)
        assert torch.equal(y[:, finite], want[finite][:, cols].T)
