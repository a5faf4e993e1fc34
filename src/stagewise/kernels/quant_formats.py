"""GGUF block formats in torch: a row of blocks <-> its fields (integer codes and scales) <-> values.

Owns the file layout of the types stagewise runs quantized (ggml's `ggml-common.h` defines them;
gguf-py's numpy readers are the test oracle): `decode` splits `[N, bytes_per_row]` uint8 rows into
`Fields`, `encode` is its inverse, `values` dequantizes fields with gguf-py's float32 operations in
gguf-py's order (so the result is bit-identical), and `quantize` makes Q8_0/Q4_0/Q4_1/Q5_0/Q5_1
fields from float rows as gguf-py's `quantize` does. The kernels' own layout lives in `quant_pack`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stagewise.checkpoint.gguf_meta import GGML_SIZES, KERNEL_TYPES, GGMLType

T = GGMLType
SUPPORTED = tuple(GGMLType[name] for name in KERNEL_TYPES)
# Offset subtracted from a code before scaling (value = d * (q - offset)); the `_1` and K types
# instead add a per-block minimum. Q8_0's int8 codes are held as uint8 q + 128.
# MXFP4's codes index a table of values instead (`_MXFP4_DOUBLED`).
OFFSET = {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 128, T.Q6_K: 32, T.Q4_1: 0, T.Q5_1: 0, T.Q4_K: 0, T.Q5_K: 0}
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6, T.MXFP4: 4}
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)      # what `quantize` makes


def block_size(qtype: T) -> int:
    return GGML_SIZES[qtype][0]


def row_bytes(qtype: T, k: int) -> int:
    size, type_size = GGML_SIZES[qtype]
    return k // size * type_size


@dataclass
class Fields:
    """One matrix's blocks taken apart. `q` [N, K] uint8 holds every element's unsigned code
    (0 .. 2**bits - 1). `d` [N, K/block] float16 (K types: one per 256; MXFP4: its uint8 E8M0
    exponents, kept as stored since fp16 cannot hold every power of two they name). `m`: the `_1` types' fp16
    minimum per block; the K types' `dmin` per 256. `sc`/`mins` (K types): uint8 scale and min
    codes per 32 (Q6_K: int8 `sc` per 16, no mins)."""

    qtype: T
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def take(self, index: torch.Tensor) -> Fields:
        pick = lambda t: None if t is None else t[index]
        return Fields(self.qtype, self.q[index], self.d[index], pick(self.m), pick(self.sc), pick(self.mins))


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16 (little-endian bytes, as the file stores them)."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _bytes(half: torch.Tensor) -> torch.Tensor:
    return half.contiguous().unsqueeze(-1).view(torch.uint8)


def _bits(raw: torch.Tensor, width: int = 1) -> torch.Tensor:
    """[..., B] uint8 -> [..., B, 8 // width] fields of `width` bits, lowest first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)
    return (raw.unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def _pack_bits(fields: torch.Tensor, width: int = 1) -> torch.Tensor:
    """`_bits`'s inverse: [..., B, 8 // width] -> [..., B] uint8."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)
    return (fields << shifts).sum(-1, dtype=torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat([qs & 15, qs >> 4], -1)


def _join_nibbles(q: torch.Tensor) -> torch.Tensor:
    half = q.shape[-1] // 2
    return (q[..., :half] & 15) | (q[..., half:] << 4)


def _scale_min_k4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit (scale, min) pairs -> two [..., 8] uint8."""
    d, m, md = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], -1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], -1)
    return sc, mins


def _join_scale_min_k4(sc: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    d = (sc[..., :4] & 63) | ((sc[..., 4:] & 48) << 2)
    m = (mins[..., :4] & 63) | ((mins[..., 4:] & 48) << 2)
    md = (sc[..., 4:] & 15) | ((mins[..., 4:] & 15) << 4)
    return torch.cat([d, m, md], -1)


def _decode_32(blocks: torch.Tensor, qtype: T) -> Fields:
    n = blocks.shape[0]
    has_min = qtype in (T.Q4_1, T.Q5_1)
    d, rest = _f16(blocks[..., 0:2]), blocks[..., (4 if has_min else 2):]
    m = _f16(blocks[..., 2:4]) if has_min else None
    if qtype == T.MXFP4:
        return Fields(qtype, _nibbles(blocks[..., 1:]).reshape(n, -1), blocks[..., 0].contiguous())
    if qtype == T.Q8_0:
        q = rest ^ 0x80
    elif qtype in (T.Q4_0, T.Q4_1):
        q = _nibbles(rest)
    else:                           # bit i of the 4 high-bit bytes (a little-endian uint32) -> element i
        q = _nibbles(rest[..., 4:]) | (_bits(rest[..., 0:4]).reshape(*rest.shape[:-1], 32) << 4)
    return Fields(qtype, q.reshape(n, -1), d, m)


def _decode_k(blocks: torch.Tensor, qtype: T) -> Fields:
    n = blocks.shape[0]
    if qtype == T.Q6_K:     # low 4 bits of element 128h + 64s + b: nibble s of ql[64h + b] (b < 64);
        #                     high 2 bits of element 128h + 32t + b: bits 2t of qh[32h + b] (b < 32)
        ql = blocks[..., 0:128].reshape(n, -1, 2, 64)
        low = torch.stack([ql & 15, ql >> 4], -2).reshape(n, -1, 256)
        high = _bits(blocks[..., 128:192].reshape(n, -1, 2, 32), width=2).transpose(-1, -2).reshape(n, -1, 256)
        return Fields(qtype, (low | (high << 4)).reshape(n, -1), _f16(blocks[..., 208:210]),
                      sc=blocks[..., 192:208].reshape(n, -1).view(torch.int8))
    sc, mins = _scale_min_k4(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(n, -1, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], -2).reshape(n, -1, 256)      # sub-block 2j: low nibbles, 2j+1: high
    if qtype == T.Q5_K:             # bit j of qh[l] is the high bit of element 32 j + l
        q = q | (_bits(blocks[..., 16:48]).transpose(-1, -2).reshape(n, -1, 256) << 4)
    return Fields(qtype, q.reshape(n, -1), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]),
                  sc.reshape(n, -1), mins.reshape(n, -1))


def decode(data: torch.Tensor, qtype: T, k: int) -> Fields:
    """Split `[N, row_bytes]` uint8 file rows into their fields."""
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype.name} has no quantized kernel in stagewise")
    blocks = data.reshape(data.shape[0], k // block_size(qtype), GGML_SIZES[qtype][1])
    return _decode_k(blocks, qtype) if qtype in K_TYPES else _decode_32(blocks, qtype)


def encode(f: Fields) -> torch.Tensor:
    """`decode`'s inverse: `[N, row_bytes]` uint8 file rows."""
    qtype, n, k = f.qtype, f.q.shape[0], f.q.shape[1]
    q = f.q.reshape(n, k // block_size(qtype), block_size(qtype))
    parts: list[torch.Tensor] = [f.d.unsqueeze(-1) if qtype == T.MXFP4 else _bytes(f.d)]
    if f.m is not None and qtype not in K_TYPES:
        parts.append(_bytes(f.m))
    if qtype in (T.Q4_0, T.Q4_1, T.MXFP4):
        parts.append(_join_nibbles(q))
    elif qtype in (T.Q5_0, T.Q5_1):
        parts += [_pack_bits((q >> 4).reshape(n, -1, 4, 8)).reshape(n, -1, 4), _join_nibbles(q & 15)]
    elif qtype == T.Q8_0:
        parts.append(q ^ 0x80)
    elif qtype in (T.Q4_K, T.Q5_K):
        assert f.m is not None and f.sc is not None and f.mins is not None
        parts += [_bytes(f.m), _join_scale_min_k4(f.sc.reshape(n, -1, 8), f.mins.reshape(n, -1, 8))]
        if qtype == T.Q5_K:
            parts.append(_pack_bits((q >> 4).reshape(n, -1, 8, 32).transpose(-1, -2)))
        pairs = (q & 15).reshape(n, -1, 4, 2, 32)
        parts.append((pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, -1, 128))
    elif qtype == T.Q6_K:
        assert f.sc is not None
        low = (q & 15).reshape(n, -1, 2, 2, 64)
        high = (q >> 4).reshape(n, -1, 2, 4, 32).transpose(-1, -2)
        parts = [(low[..., 0, :] | (low[..., 1, :] << 4)).reshape(n, -1, 128),
                 _pack_bits(high, width=2).reshape(n, -1, 64), f.sc.view(torch.uint8).reshape(n, -1, 16), _bytes(f.d)]
    return torch.cat(parts, -1).reshape(n, -1)


def values(f: Fields) -> torch.Tensor:
    """float32 `[N, K]`, computed as gguf-py's dequantizers compute them (same operations, same order)."""
    qtype, n, k = f.qtype, f.q.shape[0], f.q.shape[1]
    if qtype in K_TYPES:
        assert f.sc is not None
        sub = 16 if qtype == T.Q6_K else 32
        d = (f.d.float().unsqueeze(-1) * f.sc.float().reshape(n, -1, 256 // sub)).reshape(n, -1, 1)
        q = f.q.reshape(n, -1, sub)
        if qtype == T.Q6_K:
            return (d * (q.to(torch.int8) - 32).float()).reshape(n, k)
        assert f.m is not None and f.mins is not None
        dm = (f.m.float().unsqueeze(-1) * f.mins.float().reshape(n, -1, 8)).reshape(n, -1, 1)
        return (d * q.float() - dm).reshape(n, k)
    q = f.q.reshape(n, -1, block_size(qtype))
    if qtype == T.MXFP4:
        table = torch.tensor(_MXFP4_DOUBLED, dtype=torch.float32, device=q.device)
        return (e8m0_half(f.d).unsqueeze(-1) * table[q.long()]).reshape(n, k)
    d = f.d.float().unsqueeze(-1)
    if f.m is not None:
        return (d * q.float() + f.m.float().unsqueeze(-1)).reshape(n, k)
    return (d * (q.to(torch.int16) - OFFSET[qtype]).float()).reshape(n, k)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """gguf-py's `np_roundf`: half away from zero."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def quantize(weight: torch.Tensor, qtype: T) -> Fields:
    """Fields of float rows `[N, K]` (K % 32 == 0) as gguf-py's `quantize` makes them (Q8_0, Q4_0,
    Q4_1, Q5_0, Q5_1: round to nearest with the block's absolute max or its range)."""
    n, k = weight.shape
    x = weight.float().reshape(n, k // 32, 32)
    inverse = lambda d: torch.where(d == 0, 0.0, 1 / d)
    if qtype == T.Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127
        q = _round_away(x * inverse(d)).to(torch.int8).view(torch.uint8) ^ 0x80
        return Fields(qtype, q.reshape(n, k), d.squeeze(-1).half())
    if qtype in (T.Q4_0, T.Q5_0):
        levels = 16 if qtype == T.Q4_0 else 32
        peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))
        d = peak / -(levels // 2)
        q = torch.trunc(x * inverse(d) + (levels // 2 + 0.5)).to(torch.uint8).clamp(0, levels - 1)
        return Fields(qtype, q.reshape(n, k), d.squeeze(-1).half())
    if qtype in (T.Q4_1, T.Q5_1):
        levels = 16 if qtype == T.Q4_1 else 32
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (high - low) / (levels - 1)
        q = torch.trunc((x - low) * inverse(d) + 0.5).to(torch.uint8).clamp(0, levels - 1)
        return Fields(qtype, q.reshape(n, k), d.squeeze(-1).half(), low.squeeze(-1).half())
    raise ValueError(f"stagewise quantizes to Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1, not {qtype.name}")


# MXFP4 (OCP microscaling, GGML type 39): blocks of 32 E2M1 codes sharing an E8M0 scale byte; ggml
# stores the codes doubled (so every value is an integer) with the scale halved, as gguf-py reads them
_MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 2^(e - 128), ggml_e8m0_to_fp32_half (subnormal below e = 2):
    the halved scale of the doubled codes."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def mxfp4_values(raw: torch.Tensor, k: int) -> torch.Tensor:
    """MXFP4 rows `[..., k / 32 * 17]` uint8 (per block: the scale byte, then 16 bytes whose low
    nibbles are codes 0-15 and high nibbles codes 16-31) -> float32 `[..., k]`, gguf-py's values."""
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, 17)
    scale = e8m0_half(blocks[:, :1])
    qs = blocks[:, 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()                 # [n, 32]
    table = torch.tensor(_MXFP4_DOUBLED, dtype=torch.float32, device=raw.device)
    return (scale * table[codes]).reshape(*lead, k)
