"""Quantized linear against `F.linear` on the dequantized weight, and its argument checks."""
import pytest
import torch
import torch.nn.functional as F
from quant_blocks import TYPES, random_blocks

from stagewise.kernels import quant
from stagewise.kernels.quant import QuantizedWeight


def _weight(qtype, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight.from_gguf(random_blocks(qtype, n, k, gen), qtype, (n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("packed", [False, True])
def test_exact_equals_f_linear(qtype, packed):
    w = _weight(qtype, 37, 256)
    w = w.pack() if packed else w
    gen = torch.Generator().manual_seed(1)
    x, b = torch.randn(5, 256, generator=gen), torch.randn(37, generator=gen)
    ref = F.linear(x, quant.dequantize(w), b)
    torch.testing.assert_close(quant.linear(x, w, b, exact=True), ref, rtol=1e-5, atol=1e-4)
    y = quant.linear(x.bfloat16().reshape(1, 5, 256), w, exact=True)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 5, 37)
    assert quant.linear(x.bfloat16(), w, f32_out=True).dtype == torch.float32


def test_wrong_k_raises():
    w = _weight(quant.T.Q4_0, 16, 64)
    with pytest.raises(ValueError, match="features"):
        quant.linear(torch.randn(2, 32), w)
