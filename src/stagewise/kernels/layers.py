"""A decode step's decoder layers in one call: the op `stagewise::decode_layers` (csrc/layers_ops.cpp).

`decode_layers(hidden, residual, cos, sin, slots, block_ids, seq_lens, norms, data, qtypes, ns,
parts, caches, heads, kv_heads, eps, scale, exact)` -> `(hidden, residual)` runs Llama-style
pre-norm layers (fused add + RMSNorm, qkv projection, rope with the KV write, in-place decode
attention, o projection, add + RMSNorm, gate/up projection, silu(gate) * up, down projection) on
one-token sequences, every projection a packed quantized weight: the ops model/llama.py's
modules call in an eager CPU decode step, in their order, so the results are their bits. Per
layer: one KV cache, two norm weights (input, post-attention), four projections (qkv, o, gate_up,
down) of `parts` segments each, their packed `data`, `qtypes` and row counts `ns` flattened in
order. Without `residual` the first layer starts the residual stream from `hidden`.

The Python registration below runs the same ops one by one (the reference); the C++ one runs
them without Python in between, which is what a small model's decode step is mostly made of.
"""
from __future__ import annotations

import functools

import torch

from . import attention, native, norm, quant_kernels, rope, team
from .registry import define


@functools.cache
def available() -> bool:
    """The C++ op is registered, and so are the C++ kernels of the ops it calls (where any of them
    runs in Python, the model's own modules are as fast)."""
    lib = team.library()
    kernels = (norm.available(), quant_kernels.available(), rope.available(), attention.available())
    if lib is None or not all(kernels) or not all(native.loaded(n) for n in ("norm", "quant", "rope", "attention")):
        return False
    return native.load("layers", lib) is not None


def _check(hidden, norms, data, qtypes, ns, parts, caches) -> None:
    layers = len(caches)
    ok = (layers >= 1 and len(norms) == 2 * layers and len(parts) == 4 * layers and hidden.dim() == 2
          and all(p >= 1 for p in parts) and len(data) == len(qtypes) == len(ns) == sum(parts))
    if not ok:
        raise ValueError(f"stagewise decode_layers: {len(caches)} caches, {len(norms)} norm weights, {len(parts)} "
                         f"projection part counts and {len(data)} weight segments for hidden {list(hidden.shape)}; it "
                         "needs, per layer, one KV cache, two norm weights and four projections (qkv, o, gate_up, "
                         "down) of at least one segment each, and hidden [T, H].")


def _project(x, data, qtypes, ns, first, count, exact):
    if count == 1:
        return torch.ops.stagewise.qlinear(x, data[first], None, qtypes[first], ns[first], True, exact, False)
    return torch.ops.stagewise.qlinear_cat(x, data[first:first + count], None, qtypes[first:first + count],
                                           ns[first:first + count], exact, False)


def _decode_layers(hidden, residual, cos, sin, slots, block_ids, seq_lens, norms, data, qtypes, ns, parts, caches,
                   heads, kv_heads, eps, scale, exact):
    _check(hidden, norms, data, qtypes, ns, parts, caches)
    rows, seg = hidden.shape[0], 0
    res = hidden if residual is None else residual
    for layer, cache in enumerate(caches):
        if layer == 0 and residual is None:
            x = norm.rms_norm(hidden, None, norms[0], eps)[0]
        else:
            x, res = norm.rms_norm(hidden, res, norms[2 * layer], eps)
        p = parts[4 * layer:4 * layer + 4]
        qkv = _project(x, data, qtypes, ns, seg, p[0], exact)
        q, _ = rope.rope_kv(qkv, cos, sin, heads, kv_heads, cache, slots)
        out = attention.decode_attention(q, cache, block_ids, seq_lens, scale).reshape(rows, -1)
        h, res = norm.rms_norm(_project(out, data, qtypes, ns, seg + p[0], p[1], exact), res, norms[2 * layer + 1], eps)
        gate, up = _project(h, data, qtypes, ns, seg + p[0] + p[1], p[2], exact).chunk(2, dim=-1)
        hidden = _project(torch.nn.functional.silu(gate) * up, data, qtypes, ns, seg + sum(p[:3]), p[3], exact)
        seg += sum(p)
    return hidden, res


def _fake(hidden, residual, *args):
    return hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape)


define("decode_layers(Tensor hidden, Tensor? residual, Tensor cos, Tensor sin, Tensor slots, Tensor block_ids, "
       "Tensor seq_lens, Tensor[] norms, Tensor[] data, int[] qtypes, int[] ns, int[] parts, Tensor(a!)[] caches, "
       "int heads, int kv_heads, float eps, float scale, bool exact) -> (Tensor, Tensor)", _decode_layers, _fake)
