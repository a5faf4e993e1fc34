"""The recurrences of linear-attention layers in PyTorch: the short causal convolution over a
per-request window of past inputs, and the gated delta rule (chunked for a prompt's rows, one step
per decode row), both continuing from and updating a request's state slot.

These are the eager reference (transformers' torch fallbacks compute the same); a C kernel with
the project's ISA builds is a later step. Every function works on one step's rows, token-major.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64      # rows of one chunk of the chunked delta rule (as transformers' fallback)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def conv_rows(rows: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One sequence's rows `[n, C]` through the depthwise causal conv (`weight` `[C, 1, K]`), its window
    of the last K-1 inputs `state` `[C, K-1]` before them (updated in place) -> silu(conv) `[n, C]`."""
    x = torch.cat([state.to(rows.dtype), rows.t()], -1)                      # [C, K-1+n]
    state.copy_(x[:, x.shape[1] - state.shape[1]:])
    out = F.conv1d(x[None].to(weight.dtype), weight, groups=x.shape[0])[0]   # [C, n]
    return F.silu(out).t().to(rows.dtype)


def conv_step(rows: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per sequence `[B, C]` with their windows `states` `[B, C, K-1]` (returned updated, not
    in place: they are a gathered copy) -> (silu(conv) `[B, C]`, new windows)."""
    x = torch.cat([states.to(rows.dtype), rows[:, :, None]], -1)             # [B, C, K]
    out = F.conv1d(x.to(weight.dtype), weight, groups=x.shape[1])[:, :, 0]   # [B, C]
    return F.silu(out).to(rows.dtype), x[:, :, 1:]


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """q and k l2-normed in float32, repeated to v's heads: each q/k head serves consecutive v heads
    (transformers' order), or with `tiled` v head j pairs with q/k head j % Hk (llama.cpp's files);
    the query scale 1/sqrt(dk)."""
    rep = v.shape[-2] // k.shape[-2]
    q, k = l2norm(q.float()), l2norm(k.float())
    if rep > 1 and tiled:
        reps = (1,) * (q.dim() - 2) + (rep, 1)
        q, k = q.repeat(*reps), k.repeat(*reps)
    elif rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k, q.shape[-1] ** -0.5


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """One sequence's rows: q/k `[n, Hk, Dk]`, v `[n, Hv, Dv]`, log-decay g and beta `[n, Hv]`, from
    `state` `[Hv, Dk, Dv]` (float32, updated in place) -> out `[n, Hv, Dv]` in v's dtype. The WY form
    within chunks of CHUNK rows, a scan over chunks. `tiled`: the value heads' order (`_heads`)."""
    n, dtype = q.shape[0], v.dtype
    q, k, scale = _heads(q, k, v, tiled)
    q, k, v = (x.transpose(0, 1) for x in (q * scale, k, v.float()))           # [H, n, D]
    g, beta = g.float().t(), beta.float().t()                                   # [H, n]
    pad = (-n) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    h = q.shape[0]
    q, k, v = (x.reshape(h, -1, CHUNK, x.shape[-1]) for x in (q, k, v))        # [H, N, C, D]
    g, beta = g.reshape(h, -1, CHUNK).cumsum(-1), beta.reshape(h, -1, CHUNK)    # g: cumulative within a chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()     # [H, N, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]                            # [H, N, 1, 1]
    out = torch.empty_like(values)
    s = state
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_decay[:, i] @ s
        out[:, i] = q[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1).to(dtype)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per sequence: q/k `[B, Hk, Dk]`, v `[B, Hv, Dv]`, g and beta `[B, Hv]`, states `[B, Hv,
    Dk, Dv]` (float32) -> (out `[B, Hv, Dv]` in v's dtype, the new states)."""
    dtype = v.dtype
    q, k, scale = _heads(q, k, v, tiled)
    s = state * g.float().exp()[..., None, None]
    delta = (v.float() - (s * k[..., None]).sum(-2)) * beta.float()[..., None]     # [B, H, Dv]
    s = s + k[..., None] * delta[..., None, :]
    return ((s * (q * scale)[..., None]).sum(-2)).to(dtype), s
