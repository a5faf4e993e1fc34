"""Which layers of a config keep a recurrent state per request instead of KV blocks (linear
attention), and what one request's state costs: read from the config alone, without torch, by the
engine (prefix caching), the planner (`stagewise plan`) and the model families.
"""
from __future__ import annotations

RECURRENT_KINDS = ("linear_attention",)      # `layer_types` entries of recurrent layers (Qwen3.5)


def recurrent_layers(hf_config) -> list[int]:
    """The layers of `hf_config` that keep a recurrent state per request instead of KV blocks."""
    return [i for i, kind in enumerate(getattr(hf_config, "layer_types", None) or ()) if kind in RECURRENT_KINDS]


def state_bytes_per_request(hf_config, layer_ids: range, itemsize: int) -> int:
    """One request's recurrent state over the recurrent layers among `layer_ids`: per layer the conv
    window (`(2 Hk Dk + Hv Dv) * (K - 1)` values of the model dtype, `itemsize` bytes) and the delta
    rule's `Hv * Dk * Dv` float32 matrix."""
    own = [i for i in recurrent_layers(hf_config) if i in layer_ids]
    if not own:
        return 0
    c = hf_config
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    per_layer = (conv_dim * (c.linear_conv_kernel_dim - 1) * itemsize
                 + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4)
    return len(own) * per_layer
