"""The kernels' layout of quantized weights: panels of 16 rows, the same bytes as the file reordered.

A panel holds 16 consecutive rows' blocks interleaved so that the kernels read it as one stream
and every 64-byte vector serves 16 output columns at once: for each 32-element chunk of K, vector
g (g = 0..7) holds, at byte 4 r + i, the code of row r at k = 32 c + 4 g + i. That is the operand
of a 4-way int8 dot product (vpdpbusd, or maddubs + madd) for 16 columns, and a 32-bit shift and
mask of it gives 16 columns' codes at one k for the float kernels. Codes are split by bits as in
the file: Q4 nibbles pair vector g with g + 4 in one byte; the 5th bits of a chunk are one vector
(bit g of byte 4 r + i); Q6_K's two high bits are two vectors (bits 2t of vector h: group 4h + t);
Q8_0 keeps its 8 vectors (int8 + 128); MXFP4's E2M1 codes are nibbles as Q4_0's. Scales come
first: per chunk the 16 rows' fp16 d (and m; MXFP4: their 16 E8M0 bytes); per 256 for the K
types: fp16 d, dmin, then the 6-bit scale/min codes widened to bytes, [8][16] each (Q6_K: int8
[16][16]): Q4_K/Q5_K panels are 1.03/1.02x the file's bytes, the others equal.
A matrix whose N is not a multiple of 32 gets zero rows (zero scales) up to a whole pair of panels.
"""
from __future__ import annotations

import torch

from .quant_formats import BITS, K_TYPES, Fields, T

PANEL = 16          # rows per panel
CHUNK = 32          # K elements per chunk (one activation block)
ROW_ALIGN = 32      # rows are padded to whole pairs of panels: a kernel tile is two panels wide


def _has_min(qtype: T) -> bool:
    return qtype in (T.Q4_1, T.Q5_1)


def _quant_bytes(qtype: T) -> int:
    """Bytes of one chunk's codes for a panel."""
    return {4: 256, 5: 320, 6: 384, 8: 512}[BITS[qtype]]


def _header_bytes(qtype: T) -> int:
    """Bytes of scales before each chunk (32-block types) or each 256 (K types)."""
    if qtype in (T.Q4_K, T.Q5_K):
        return 4 * PANEL + 2 * 8 * PANEL
    if qtype == T.Q6_K:
        return 2 * PANEL + 16 * PANEL
    if qtype == T.MXFP4:                # its E8M0 byte per row: the panel holds the file's bytes
        return PANEL
    return (4 if _has_min(qtype) else 2) * PANEL


def panel_bytes(qtype: T, k: int) -> int:
    chunks = k // CHUNK
    if qtype in K_TYPES:
        return k // 256 * _header_bytes(qtype) + chunks * _quant_bytes(qtype)
    return chunks * (_header_bytes(qtype) + _quant_bytes(qtype))


def num_panels(n: int) -> int:
    return -(-n // ROW_ALIGN) * (ROW_ALIGN // PANEL)


def _groups(q: torch.Tensor) -> torch.Tensor:
    """[16 P, K] codes -> [P, C, 8, 64]: per chunk c, vector g, byte 4 r + i = q[r, 32 c + 4 g + i]."""
    p, k = q.shape[0] // PANEL, q.shape[1]
    return q.reshape(p, PANEL, k // CHUNK, 8, 4).permute(0, 2, 3, 1, 4).reshape(p, k // CHUNK, 8, 64)


def _ungroup(g: torch.Tensor) -> torch.Tensor:
    p, c = g.shape[0], g.shape[1]
    return g.reshape(p, c, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, c * CHUNK)


def _shifts(count: int, width: int) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.uint8) * width).view(count, 1)


def _encode_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[16 P, K] codes -> [P, C, chunk quant bytes]."""
    g = _groups(q)
    if bits == 8:
        return g.flatten(2)
    parts = [((g[:, :, :4] & 15) | ((g[:, :, 4:] & 15) << 4)).flatten(2)]
    if bits == 5:
        parts.append(((g >> 4) << _shifts(8, 1)).sum(2, dtype=torch.uint8))
    elif bits == 6:
        high = (g >> 4).reshape(*g.shape[:2], 2, 4, 64)
        parts.append((high << _shifts(4, 2)).sum(3, dtype=torch.uint8).flatten(2))
    return torch.cat(parts, -1)


def _decode_codes(raw: torch.Tensor, bits: int) -> torch.Tensor:
    """`_encode_codes`'s inverse: [P, C, bytes] -> [16 P, K]."""
    p, c = raw.shape[0], raw.shape[1]
    if bits == 8:
        return _ungroup(raw.reshape(p, c, 8, 64))
    nib = raw[..., :256].reshape(p, c, 4, 64)
    g = torch.cat([nib & 15, nib >> 4], 2)
    if bits == 5:
        g = g | (((raw[..., 256:320].unsqueeze(2) >> _shifts(8, 1)) & 1) << 4)
    elif bits == 6:
        high = (raw[..., 256:384].reshape(p, c, 2, 1, 64) >> _shifts(4, 2)) & 3
        g = g | (high.reshape(p, c, 8, 64) << 4)
    return _ungroup(g)


def _per_panel(t: torch.Tensor, inner: int = 1) -> torch.Tensor:
    """[16 P, S * inner] per-row values -> [P, S, inner * 16] bytes, rows innermost."""
    p = t.shape[0] // PANEL
    t = t.reshape(p, PANEL, -1, inner).permute(0, 2, 3, 1).contiguous()
    return t.view(torch.uint8).reshape(p, t.shape[1], -1)


def _from_panel(raw: torch.Tensor, dtype: torch.dtype, inner: int = 1) -> torch.Tensor:
    p, s = raw.shape[0], raw.shape[1]
    t = raw.contiguous().view(dtype).reshape(p, s, inner, PANEL)
    return t.permute(0, 3, 1, 2).reshape(p * PANEL, s * inner)


def _pad(f: Fields) -> Fields:
    pad = num_panels(f.q.shape[0]) * PANEL - f.q.shape[0]
    if not pad:
        return f
    grow = lambda t: None if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return Fields(f.qtype, grow(f.q), grow(f.d), grow(f.m), grow(f.sc), grow(f.mins))  # type: ignore[arg-type]


def encode(f: Fields) -> torch.Tensor:
    """Fields of N rows -> `[ceil(N / 16), panel_bytes]` uint8 panels."""
    f = _pad(f)
    qtype, p = f.qtype, f.q.shape[0] // PANEL
    codes = _encode_codes(f.q, BITS[qtype])                              # [P, C, qb]
    if qtype not in K_TYPES:
        header = [_per_panel(f.d)] + ([_per_panel(f.m)] if f.m is not None else [])
        return torch.cat([*header, codes], -1).reshape(p, -1)
    assert f.sc is not None
    header = [_per_panel(f.d)]
    if qtype == T.Q6_K:
        header.append(_per_panel(f.sc, 16))
    else:
        assert f.m is not None and f.mins is not None
        header += [_per_panel(f.m), _per_panel(f.sc, 8), _per_panel(f.mins, 8)]
    return torch.cat([*header, codes.reshape(p, codes.shape[1] // 8, -1)], -1).reshape(p, -1)


def decode(panels: torch.Tensor, qtype: T, n: int, k: int) -> Fields:
    """`encode`'s inverse for the first `n` rows (the padding dropped)."""
    p, chunks, qb = panels.shape[0], k // CHUNK, _quant_bytes(qtype)
    if qtype not in K_TYPES:
        raw = panels.reshape(p, chunks, -1)
        if qtype == T.MXFP4:
            d = _from_panel(raw[..., :PANEL], torch.uint8)
        else:
            d = _from_panel(raw[..., :32], torch.float16)
        m = _from_panel(raw[..., 32:64], torch.float16) if _has_min(qtype) else None
        f = Fields(qtype, _decode_codes(raw[..., -qb:], BITS[qtype]), d, m)
    else:
        raw = panels.reshape(p, k // 256, -1)
        head = _header_bytes(qtype)
        codes = _decode_codes(raw[..., head:].reshape(p, chunks, qb), BITS[qtype])
        d = _from_panel(raw[..., :32], torch.float16)
        if qtype == T.Q6_K:
            f = Fields(qtype, codes, d, sc=_from_panel(raw[..., 32:288], torch.int8, 16))
        else:
            f = Fields(qtype, codes, d, _from_panel(raw[..., 32:64], torch.float16),
                       _from_panel(raw[..., 64:192], torch.uint8, 8), _from_panel(raw[..., 192:320], torch.uint8, 8))
    return f if n == p * PANEL else f.take(torch.arange(n))
