"""Facts about a checkpoint that the driver needs without building a model."""
from __future__ import annotations

from ..model.loader import load_hf_config


def num_layers_of(model_dir: str) -> int:
    cfg = load_hf_config(model_dir)
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    if not n:
        raise ValueError(f"{model_dir}/config.json names no layer count (num_hidden_layers or n_layer).")
    return int(n)


def eos_token_ids_of(model_dir: str, hf_config) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json."""
    eos = None
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):
        pass
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
