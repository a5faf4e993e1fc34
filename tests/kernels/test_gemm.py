"""The small-row CPU linear kernel against `F.linear`: every row count the tiles cover (full and
partial weight tiles, blocks of four rows), biases, bf16 weights, strided activation rows, batch invariance, and
the dispatch that keeps MKL from `MAX_ROWS` rows up and for what the kernel does not serve; the
packed kernels likewise (any N; a weight's row slices give the whole's bits), and packing layers in place."""
import pytest
import torch
import torch.nn.functional as F

from stagewise.kernels import build
from stagewise.kernels import gemm as cpu_gemm
from stagewise.model import cpu_gemm as layers

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")


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


@pytest.mark.slow
def test_the_compiled_op_picks_by_rows_at_run_time():
    """Under torch.compile with a dynamic row dimension the call is the opaque op, and it matches
    F.linear on both sides of the crossover from one compiled graph."""
    lin = layers.Linear(64, 48, bias=True).requires_grad_(False)     # the engine never trains
    fn = torch.compile(lambda x: torch.relu(lin(x)), dynamic=True, fullgraph=True)
    for rows in (3, cpu_gemm.MAX_ROWS + 5):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(fn(x), torch.relu(F.linear(x, lin.weight, lin.bias)), atol=1e-4, rtol=1e-4)


# --- prepacked weights ----------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float32]          # every build has the packed kernels of both


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(960, 576), (80, 64), (48, 2)])
def test_pack_round_trips(n, k, dtype):
    w = torch.randn(n, k).to(dtype)
    packed = cpu_gemm.pack(w)
    assert packed.shape == w.shape and torch.equal(cpu_gemm.unpack(packed), w)
    assert k == 2 or not torch.equal(packed, w)          # one pair per row: the layouts coincide


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 3, 6, 7, 13, 50, 130])
@pytest.mark.parametrize("n,k", [(960, 576), (80, 64), (48, 1536)])
def test_packed_kernel_equals_f_linear(rows, n, k, dtype):
    """Every row-tile height (1-6, and chunks of 48 rows) and panel width (full and the narrower
    last one), with and without bias; each row's result is the same alone or batched. bf16:
    exact products summed in float32, one rounding."""
    gen = torch.Generator().manual_seed(rows + n + k)
    x, w, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((rows, k), (n, k), (n,)))
    packed = cpu_gemm.pack(w)
    tol = dict(atol=0.05, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-4 * k ** 0.5, rtol=1e-4)
    for bias in (None, b):
        got = cpu_gemm.linear_packed(x, packed, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(got.float(), ref, **tol)
    if rows:
        alone = torch.cat([cpu_gemm.linear_packed(x[i:i + 1], packed, b) for i in range(rows)])
        assert torch.equal(cpu_gemm.linear_packed(x, packed, b), alone)
    if dtype == torch.bfloat16:          # logits: the same sums in float32, unrounded
        wide = cpu_gemm.linear_packed(x, packed, b, f32_out=True)
        assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), cpu_gemm.linear_packed(x, packed, b))
        torch.testing.assert_close(wide, F.linear(x.float(), w.float(), b.float()), atol=1e-4 * k ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_n_and_its_shards_give_the_whole_weights_bits(dtype):
    """A weight of any N packs (the last panel's columns past its last vector one by one, the same
    chain per output; bf16 pairs excepted, N % 16 == 0), and its row slices, packed apart as
    tensor-parallel ranks hold them, give each output the bits of the whole weight's."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 64, generator=gen).to(dtype)
    for n in (1000, 37, 11, 1):
        w, b = torch.randn(n, 64, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
        if not cpu_gemm.packable(w):
            assert cpu_gemm.layout(dtype)[1] == 2 and n % 16, (n, cpu_gemm.layout(dtype))
            continue
        whole = cpu_gemm.linear_packed(x, cpu_gemm.pack(w), b)
        torch.testing.assert_close(whole.float(), F.linear(x.float(), w.float(), b.float()),
                                   **(dict(atol=0.05, rtol=1e-2) if dtype == torch.bfloat16 else {}))
        for cut in {n // 2, n // 3}:
            parts = [cpu_gemm.linear_packed(x, cpu_gemm.pack(w[s].contiguous()), b[s])
                     for s in (slice(0, cut), slice(cut, n)) if s.stop > s.start]
            assert torch.equal(torch.cat(parts, dim=1), whole), (n, cut)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_head_embedding_of_any_vocabulary_packs(dtype):
    """A tied head's Embedding packs whatever its row count; lookups gather each token's row out of
    the packed layout, the narrower last panel too."""
    for n in (1000, 16 * 3 + 5):
        emb = layers.Embedding(n, 64, dtype=dtype).requires_grad_(False)
        emb.serves_head = True
        ref = emb.weight.clone()
        ids = torch.tensor([[0, n - 1, n // 2], [n - 2, 17, 1]])
        assert emb.pack_() == cpu_gemm.packable(ref) and torch.equal(emb(ids), ref[ids])


@pytest.mark.slow
def test_layers_pack_in_place_and_the_compiled_op_matches(monkeypatch):
    """`pack_linears` reorders a Linear's weight (and a head-serving Embedding's) in its own
    storage; outputs and token lookups stay what they were, eager and under torch.compile."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.proj = layers.Linear(64, 96, bias=True, dtype=torch.bfloat16).requires_grad_(False)
    model.embed = layers.Embedding(128, 64, dtype=torch.bfloat16).requires_grad_(False)
    model.plain = layers.Embedding(128, 64, dtype=torch.bfloat16).requires_grad_(False)
    model.embed.serves_head = True
    x, ids = torch.randn(5, 64).bfloat16(), torch.tensor([0, 3, 64, 127])
    before = model.proj(x), model.embed(ids), model.embed.as_head(x)
    ptr = model.proj.weight.data_ptr()
    monkeypatch.setenv("STAGEWISE_PACKED_WEIGHTS", "0")
    assert layers.pack_linears(model) == 0
    monkeypatch.delenv("STAGEWISE_PACKED_WEIGHTS")
    assert layers.pack_linears(model) == 2 and model.proj.packed and model.embed.packed and not model.plain.packed
    assert model.proj.weight.data_ptr() == ptr                  # no second copy
    assert torch.equal(model.embed(ids), before[1])
    for got, ref in ((model.proj(x), before[0]), (model.embed.as_head(x), before[2])):
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=1e-2)
    fn = torch.compile(lambda t: torch.relu(model.proj(t)), dynamic=True, fullgraph=True)
    for rows in (3, 40):
        t = torch.randn(rows, 64).bfloat16()
        assert torch.equal(fn(t), torch.relu(model.proj(t)))
