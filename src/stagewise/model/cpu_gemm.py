"""Linear layers on CPU as modules: `Linear` and `Embedding` run the kernels of `kernels.gemm`
(the small-row kernel, or the packed one once `pack_linears` has reordered their weights after
loading), with the same parameters and checkpoints as `nn.Linear` / `nn.Embedding`.
"""
from __future__ import annotations

import torch

from ..kernels.gemm import layout, linear, linear_packed, pack, packable

__all__ = ["Embedding", "Linear", "linear", "logits", "pack_linears"]


def logits(hidden: torch.Tensor, weight: torch.Tensor, packed: bool) -> torch.Tensor:
    """float32 logits `[R, V]` of an LM head: a packed bf16 head writes them unrounded (bf16 logits
    of a ~25 magnitude are 0.125 apart, enough to tie or flip a near-tie greedy pick)."""
    if packed:
        return linear_packed(hidden, weight, None, f32_out=weight.dtype == torch.bfloat16).float()
    return linear(hidden, weight).float()


class Linear(torch.nn.Linear):
    """`nn.Linear` whose forward is `linear` (same parameters, same checkpoints). After `pack_`
    the weight holds the packed layout and every call goes to the packed kernel."""

    packed = False

    def pack_(self) -> bool:
        """Reorder the weight in place of the checkpoint layout where `packable`; True if it was."""
        if self.packed or not packable(self.weight):
            return False
        with torch.no_grad():
            self.weight.copy_(pack(self.weight))      # in the same storage: no second copy stays
        self.packed = True
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return linear_packed(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


class Embedding(torch.nn.Embedding):
    """`nn.Embedding`. Where it is also the LM head (tied weights on a stage that is first and
    last; the model sets `serves_head`), `pack_` packs its weight for the head's GEMMs and a
    lookup gathers each token's row out of the packed layout."""

    packed = False
    serves_head = False
    layout = (1, 1)       # (panel width, k per pair) once packed

    def reset_parameters(self) -> None:
        """nn.Embedding's random init, skipped on the meta device (where stages are built before
        loading): a meta weight has no values to draw, and there normal_ runs torch._refs' Python
        version, whose first call imports torch._dynamo (~115 MB resident with sympy and triton)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def pack_(self) -> bool:
        found = layout(self.weight.dtype)
        if self.packed or not self.serves_head or found is None or not packable(self.weight):
            return False
        with torch.no_grad():
            self.weight.copy_(pack(self.weight))
        self.packed, self.layout = True, found
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return super().forward(ids)
        panel, pair = self.layout
        n, k = self.weight.shape
        flat = ids.reshape(-1)
        if n % panel == 0:
            panels = self.weight.view(n // panel, k // pair, panel, pair)
            return panels[flat // panel, :, flat % panel].reshape(*ids.shape, k)   # [..., K/pair, pair] -> [..., K]
        # a last panel narrower than the rest (`pack`): each row's elements by their offsets
        full = n // panel * panel
        width = torch.where(flat < full, panel, n - full)
        at = (flat // panel * panel * k + flat % panel * pair)[:, None] \
            + (torch.arange(k // pair) * pair)[None, :] * width[:, None]
        at = (at[:, :, None] + torch.arange(pair)).reshape(-1, k)
        return self.weight.reshape(-1)[at].reshape(*ids.shape, k)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of `hidden` `[R, H]` against this (tied) weight."""
        return logits(hidden, self.weight, self.packed)


def pack_linears(model: torch.nn.Module) -> int:
    """`pack_` on every `Linear` and head-serving `Embedding` of `model`, once its weights are
    loaded: how many weights were packed."""
    return sum(m.pack_() for m in model.modules() if isinstance(m, (Linear, Embedding)))
