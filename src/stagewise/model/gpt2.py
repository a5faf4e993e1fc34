"""GPT-2 stage model: learned positions, LayerNorm, residual inside each block.

The residual never leaves a block, so a non-last stage sends `hidden_states` only (the
hidden-only proxy contract). HF's Conv1D weights (`[in, out]`) are kept as stored.
"""
from __future__ import annotations

import torch
from torch import nn

from stagewise.model.attention import ForwardBatch
from stagewise.model.cpu_gemm import Embedding, linear
from stagewise.model.layers import StageModel, activation, build_layers
from stagewise.model.quantized import QuantEmbedding, QuantLinear
from stagewise.parallel.partition import StageInfo
from stagewise.parallel.proxy import HIDDEN_ONLY_CONTRACT, ProxyTensors


class Conv1D(nn.Module):
    """HF's GPT-2 projection: `x @ weight + bias` with weight `[in, out]`, so checkpoints load as-is."""

    in_out_layout = True      # a quantized replacement (model.quantized) holds it as [out, in] rows

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype))
        if not self.weight.is_meta:      # on meta normal_ runs torch._refs, which imports torch._dynamo
            nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class GPT2Attention(nn.Module):
    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        hidden = hf_config.hidden_size
        self.num_heads = hf_config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim ** -0.5 if getattr(hf_config, "scale_attn_weights", True) else 1.0
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= float(layer_id + 1)
        self.c_attn = Conv1D(hidden, 3 * hidden, dtype)
        self.c_proj = Conv1D(hidden, hidden, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = hidden.shape[0]
        q, k, v = self.c_attn(hidden).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        out = batch.attention(self.layer_id, q, k, v, self.scale)  # [T, H, D]
        return self.c_proj(out.reshape(T, -1))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str, dtype: torch.dtype):
        super().__init__()
        self.c_fc = Conv1D(hidden, inner, dtype)
        self.c_proj = Conv1D(inner, hidden, dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, hf_config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        inner = getattr(hf_config, "n_inner", None) or 4 * hidden
        self.ln_1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.attn = GPT2Attention(hf_config, layer_id, dtype)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = GPT2MLP(hidden, inner, hf_config.activation_function, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), batch)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2LMHeadModel(StageModel):
    """One pipeline stage of GPT-2.

    `embed_tokens(ids)` returns token embeddings only (wte); `forward` adds the position
    embedding (wpe) to them or to `input_embeds`, exactly as HF treats `inputs_embeds`.
    """

    proxy_keys = HIDDEN_ONLY_CONTRACT

    def __init__(self, hf_config, stage: StageInfo, dtype: torch.dtype):
        super().__init__()
        self.stage, self.dtype = stage, dtype
        self.hidden_size, self.vocab_size = hf_config.hidden_size, hf_config.vocab_size
        self.num_heads = hf_config.num_attention_heads
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        vocab = hf_config.vocab_size
        self.wte: nn.Embedding | None
        self.wpe: nn.Embedding | None
        if stage.is_first:
            # cpu_gemm's: nn.Embedding that skips its random init on the meta device
            self.wte = Embedding(vocab, self.hidden_size, dtype=dtype)
            self.wpe = Embedding(hf_config.max_position_embeddings, self.hidden_size, dtype=dtype)
        else:
            self.wte = self.wpe = None
        self.layers = build_layers(stage, lambda i: GPT2Block(hf_config, i, dtype))
        self.ln_f = (nn.LayerNorm(self.hidden_size, eps=hf_config.layer_norm_epsilon, dtype=dtype)
                     if stage.is_last else None)
        needs_head = stage.is_last and not (self.tie_word_embeddings and stage.is_first)
        self.lm_head = nn.Linear(self.hidden_size, vocab, bias=False, dtype=dtype) if needs_head else None

    def hf_name(self, param_name: str) -> str:
        if param_name.startswith("lm_head."):
            return "transformer.wte.weight" if self.tie_word_embeddings else param_name
        if param_name.startswith("layers."):
            param_name = "h." + param_name[len("layers."):]
        return "transformer." + param_name

    def canonical_name(self, hf_name: str) -> str:
        # Early GPT-2 checkpoints store the transformer's tensors without the "transformer." prefix.
        if hf_name.startswith(("transformer.", "lm_head.")):
            return hf_name
        return "transformer." + hf_name

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[T, H]` without positions (positions are added in forward)."""
        assert self.wte is not None   # built on the first stage
        return self.wte(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, batch: ForwardBatch, *,
                input_embeds: torch.Tensor | None = None, pp_proxy_tensors: ProxyTensors | None = None):
        """Non-last stage -> ProxyTensors(hidden_states) of T rows; last -> ln_f(hidden) `[T, H]`."""
        if self.stage.is_first:
            assert self.wte is not None and self.wpe is not None   # built on the first stage
            tokens = input_embeds if input_embeds is not None else self.wte(input_ids)  # [T, H]
            hidden = tokens + self.wpe(positions)
        else:
            assert pp_proxy_tensors is not None, "a non-first stage runs on the previous stage's tensors"
            hidden = pp_proxy_tensors["hidden_states"]
        for layer_id in range(self.stage.start, self.stage.end):
            hidden = self.layers[layer_id](hidden, batch)
        if not self.stage.is_last:
            return ProxyTensors({"hidden_states": hidden})
        assert self.ln_f is not None   # built on the last stage
        return self.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[R, H]` -> float32 logits `[R, V]` (last stage only)."""
        head = self.lm_head if self.lm_head is not None else self.wte
        assert head is not None   # the last stage has a head or (tied, also first) the embedding
        if isinstance(head, (QuantLinear, QuantEmbedding)):
            return head.as_head(hidden)
        return linear(hidden, head.weight).float()

    def kv_cache_spec(self) -> tuple[int, int]:
        return self.num_heads, self.hidden_size // self.num_heads
