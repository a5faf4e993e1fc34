"""A decode step's decoder layers in one call: the op `stagewise::decode_layers` (csrc/layers_ops.cpp).

`decode_layers(hidden, residual, cos, sin, slots, block_ids, seq_lens, norms, data, qtypes, ns,
parts, biases, bias_of, caches, heads, kv_heads, eps, scale, exact, spans=None)` -> `(hidden,
residual)` runs Llama-style pre-norm layers (fused add + RMSNorm, qkv projection, rope with the KV
write, in-place attention, o projection, add + RMSNorm, gate/up projection, silu(gate) * up, down
projection) on one-token sequences (`decode_attention` over `block_ids` `[T, nblk]` and `seq_lens`
`[T]`), or with `spans` on rows of a few sequences each (a verify step: `rows_attention` over span
tables `block_ids` `[S, nblk]`, `spans` `[S + 1]` and each row's keys `seq_lens` `[T]`, which give
every row the bits of a decode step), every projection a packed weight (quantized, or float in the
packed float kernels' layout: qtype -1, one segment): the ops model/llama.py's modules call in an
eager CPU decode step, in their order, so the results are their bits. Per layer: one KV cache, two
norm weights (input, post-attention), four projections (qkv, o, gate_up, down) of `parts` segments
each, their packed `data`, `qtypes` and row counts `ns` flattened in order, and each projection's
bias as an index into `biases` (`bias_of`, -1: none). Without `residual` the first layer starts
the residual stream from `hidden`.

The Python registration below runs the same ops one by one (the reference); the C++ one runs
them without Python in between, which is what a small model's decode step is mostly made of.
"""
from __future__ import annotations

import functools

import torch

from . import attention, gemm, native, norm, quant_kernels, rope, team
from .registry import define


@functools.cache
def available() -> bool:
    """The C++ op is registered, and so are the C++ kernels of the ops it calls (where any of them
    runs in Python, the model's own modules are as fast); float projections also need
    `floats_available`."""
    lib = team.library()
    kernels = (norm.available(), quant_kernels.available(), rope.available(), attention.available())
    if lib is None or not all(kernels) or not all(native.loaded(n) for n in ("norm", "quant", "rope", "attention")):
        return False
    return native.load("layers", lib) is not None


@functools.cache
def floats_available() -> bool:
    """The packed float kernels' op has its C++ registration (float projections)."""
    return gemm.available() and native.loaded("gemm")


def _check(hidden, norms, data, qtypes, ns, parts, biases, bias_of, caches) -> None:
    layers = len(caches)
    ok = (layers >= 1 and len(norms) == 2 * layers and len(parts) == 4 * layers and hidden.dim() == 2
          and all(p >= 1 for p in parts) and len(data) == len(qtypes) == len(ns) == sum(parts)
          and len(bias_of) == 4 * layers and all(-1 <= b < len(biases) for b in bias_of))
    if not ok:
        raise ValueError(f"stagewise decode_layers: {len(caches)} caches, {len(norms)} norm weights, {len(parts)} "
                         f"projection part counts and {len(data)} weight segments for hidden {list(hidden.shape)}; it "
                         "needs, per layer, one KV cache, two norm weights and four projections (qkv, o, gate_up, "
                         "down) of at least one segment each and a bias index each (-1: none) into the biases, and "
                         "hidden [T, H].")


def _decode_layers(hidden, residual, cos, sin, slots, block_ids, seq_lens, norms, data, qtypes, ns, parts, biases,
                   bias_of, caches, heads, kv_heads, eps, scale, exact, spans=None):
    _check(hidden, norms, data, qtypes, ns, parts, biases, bias_of, caches)
    rows, first = hidden.shape[0], [sum(parts[:i]) for i in range(len(parts))]

    def project(x, p):       # projection p: its parts[p] segments from first[p], its bias
        a, n, bias = first[p], parts[p], biases[bias_of[p]] if bias_of[p] >= 0 else None
        if qtypes[a] < 0:
            return torch.ops.stagewise.linear_packed(x, data[a], bias, False)
        if n == 1:
            return torch.ops.stagewise.qlinear(x, data[a], bias, qtypes[a], ns[a], True, exact, False)
        return torch.ops.stagewise.qlinear_cat(x, data[a:a + n], bias, qtypes[a:a + n], ns[a:a + n], exact, False)
    res = hidden if residual is None else residual
    for layer, cache in enumerate(caches):
        if layer == 0 and residual is None:
            x = norm.rms_norm(hidden, None, norms[0], eps)[0]
        else:
            x, res = norm.rms_norm(hidden, res, norms[2 * layer], eps)
        q, _ = rope.rope_kv(project(x, 4 * layer), cos, sin, heads, kv_heads, cache, slots)
        if spans is None:
            out = attention.decode_attention(q, cache, block_ids, seq_lens, scale).reshape(rows, -1)
        else:
            out = attention.rows_attention(q, cache, block_ids, spans, seq_lens, scale).reshape(rows, -1)
        h, res = norm.rms_norm(project(out, 4 * layer + 1), res, norms[2 * layer + 1], eps)
        gate, up = project(h, 4 * layer + 2).chunk(2, dim=-1)
        hidden = project(torch.nn.functional.silu(gate) * up, 4 * layer + 3)
    return hidden, res


def _fake(hidden, residual, *args, **kwargs):
    return hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape)


define("decode_layers(Tensor hidden, Tensor? residual, Tensor cos, Tensor sin, Tensor slots, Tensor block_ids, "
       "Tensor seq_lens, Tensor[] norms, Tensor[] data, int[] qtypes, int[] ns, int[] parts, Tensor[] biases, "
       "int[] bias_of, Tensor(a!)[] caches, int heads, int kv_heads, float eps, float scale, bool exact, "
       "Tensor? spans=None) "
       "-> (Tensor, Tensor)", _decode_layers, _fake)
