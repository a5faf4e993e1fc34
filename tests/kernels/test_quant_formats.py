"""Quantized weight formats against gguf-py: unpacking every type (file rows and the kernels'
panels) equals `gguf.quants.dequantize` bit for bit, the layouts round-trip, rows can be selected
before packing and gathered after, quantizing equals `gguf.quants.quantize`, and bad input raises."""
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from quant_blocks import TYPES, random_blocks

from stagewise.kernels import quant, quant_formats, quant_pack
from stagewise.kernels.quant import QuantizedWeight
from stagewise.kernels.quant_formats import T


def _weight(qtype, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight.from_gguf(random_blocks(qtype, n, k, gen).numpy(), qtype, (n, k))


def _oracle(w):
    return torch.from_numpy(gguf_dequantize(w.data.numpy(), w.qtype)).reshape(w.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 16, 37])
def test_dequantize_equals_gguf(qtype, n):
    w = _weight(qtype, n, 512, seed=n)
    ref = _oracle(w)
    assert torch.equal(quant.dequantize(w), ref)
    assert torch.equal(quant.dequantize(w.pack()), ref)
    assert torch.equal(quant.dequantize(w.pack(), torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layouts_round_trip(qtype):
    w = _weight(qtype, 21, 256)
    fields = quant_formats.decode(w.data, qtype, 256)
    assert torch.equal(quant_formats.encode(fields), w.data)
    packed = w.pack()
    assert packed.data.shape == (2, quant_pack.panel_bytes(qtype, 256))
    assert torch.equal(quant_formats.encode(packed.fields()), w.data)
    assert packed.pack() is packed


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_take_rows_then_dequantize(qtype):
    w = _weight(qtype, 48, 256)
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    ref = quant.dequantize(w)
    assert torch.equal(quant.dequantize(w.take_rows(perm)), ref[perm])
    assert torch.equal(quant.dequantize(w.take_rows(slice(16, 40))), ref[16:40])
    assert torch.equal(quant.dequantize(w.take_rows(perm).pack()), ref[perm])
    with pytest.raises(ValueError, match="before pack"):
        w.pack().take_rows(perm)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows(qtype):
    w = _weight(qtype, 40, 256)
    ids = torch.tensor([[39, 0, 17], [17, 5, 32]])
    ref = quant.dequantize(w)[ids]
    assert torch.equal(quant.dequantize_rows(w, ids), ref)
    assert torch.equal(quant.dequantize_rows(w.pack(), ids), ref)
    assert quant.dequantize_rows(w.pack(), ids, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(IndexError, match="Row ids"):
        quant.dequantize_rows(w.pack(), torch.tensor([40]))


def test_packed_bytes_stay_near_the_file():
    """Real 1B-class shapes: panels hold the file's bytes reordered (K types: scale codes widened)."""
    for qtype in TYPES:
        n, k = 2048, 2048
        ratio = quant_pack.num_panels(n) * quant_pack.panel_bytes(qtype, k) / (n * quant_formats.row_bytes(qtype, k))
        assert ratio <= 1.03


@pytest.mark.parametrize("qtype", quant_formats.QUANTIZABLE, ids=lambda t: t.name)
def test_quantize_equals_gguf(qtype):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(9, 96, generator=gen)
    weight[0, :32] = 0                                          # an all-zero block: d = 0
    weight[1, 32:64] = 1.5                                      # a constant block
    got = quant.quantize(weight, qtype.name.lower())
    assert got.qtype == qtype and got.shape == (9, 96)
    assert np.array_equal(got.data.numpy(), gguf_quantize(weight.numpy(), qtype))


def test_quantize_kinds():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    for kind, qtype, tolerance in (("int8", T.Q8_0, 0.02), ("int4", T.Q4_1, 0.25)):
        w = quant.quantize(weight, kind)
        assert w.qtype == qtype
        torch.testing.assert_close(quant.dequantize(w), weight, atol=tolerance, rtol=0)
    with pytest.raises(ValueError, match="Unknown quantization"):
        quant.quantize(weight, "int3")
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize(torch.randn(8, 40), "int8")


def test_from_gguf_checks():
    good = random_blocks(T.Q4_0, 4, 64, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="bytes"):
        QuantizedWeight.from_gguf(good.numpy()[:, :-1], T.Q4_0, (4, 64))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight.from_gguf(good.numpy(), T.Q4_K, (4, 64))
    with pytest.raises(ValueError, match="no quantized kernel"):
        QuantizedWeight.from_gguf(good.numpy(), T.IQ4_NL, (4, 64))
    w = QuantizedWeight.from_gguf(good.numpy().reshape(-1), T.Q4_0, (4, 64))     # any shape of the right bytes
    assert w.data.shape == (4, 36) and w.nbytes == 144
