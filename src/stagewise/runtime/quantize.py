"""Opt-in weight-only int8 for small steps (`int8_weights`): every `nn.Linear` of a stage, and a
tied LM head, gets an int8 copy of its weight with one scale per output row.

Steps of up to INT8_MAX_ROWS rows (decode at small batch) multiply with the int8 copy
(`aten._weight_int8pack_mm`: half the bytes of bf16 to stream, and a faster kernel at one row);
larger steps keep the original weight, where the int8 kernel loses to bf16 GEMMs (its cost
grows with every row, and dequantizing costs more than it saves). Needs bf16 activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX_ROWS = 4     # measured crossover on AVX512-BF16: int8 wins below ~8 rows, bf16 GEMMs above


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight `[N, K]` -> (int8 `[N, K]`, per-row scale `[N]` float32): symmetric, absmax / 127."""
    w32 = weight.detach().float()
    scale = w32.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    """A Linear with an int8 copy for steps of at most INT8_MAX_ROWS rows.

    `weight` stays the original tensor (shared with the embedding for a tied head); the int8
    copy and its scales are buffers, so the memory plan counts them via `extra_bytes`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        q, scale = quantize_rows(weight)
        self.register_buffer("qweight", q)                         # [N, K] int8
        self.register_buffer("scales", scale.to(weight.dtype))     # [N] in the activation dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT8_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return out if self.bias is None else out + self.bias


def _int8_targets(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]:
    """(parent, attribute, weight, bias) of every Linear, plus a tied head's embedding table."""
    found = [(parent, name, child.weight, child.bias) for parent in model.modules()
             for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and not isinstance(child, Int8Linear)]
    stage = getattr(model, "stage", None)
    if getattr(model, "lm_head", "absent") is None and stage is not None and stage.is_last:
        table = next((m for m in (getattr(model, "embed_tokens", None), getattr(model, "wte", None))
                      if isinstance(m, nn.Embedding)), None)
        if table is not None:   # tied head on the first stage: an int8 copy of the embedding table
            found.append((model, "lm_head", table.weight, None))
    return found


def int8_bytes(model: nn.Module) -> int:
    """Bytes `quantize_int8` adds (int8 weights + scales); works on a meta-device model."""
    return sum(w.numel() + w.shape[0] * w.element_size() for _, _, w, _ in _int8_targets(model))


def quantize_int8(model: nn.Module) -> int:
    """Give every nn.Linear of `model` (and a tied head) an int8 copy; returns the bytes added."""
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int8_weights needs bfloat16 activations, but the model runs in {dtype}; "
                         "pass --dtype bfloat16 (auto picks it on CPUs with AVX512-BF16 or AMX).")
    added = int8_bytes(model)
    for parent, name, weight, bias in _int8_targets(model):
        setattr(parent, name, Int8Linear(weight, bias))
    return added
