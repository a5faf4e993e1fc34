"""The weights of a llama.cpp GGUF LoRA file (checkpoint/lora_files.py read its facts) as per-layer
A [r, in] / B [out, r] pairs in HF layout. llama.cpp's convert_lora_to_gguf.py runs the base model's own
tensor rules on each pair, so for Llama-family files the q/k `lora_b` rows come permuted as the base
GGUF's q/k rows do: undone here with the index model/gguf.py undoes those with."""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.gguf_meta import gguf_facts
from ..checkpoint.lora_files import AdapterFacts
from .gguf import _PERMUTED_QK, _unpermute_index, dequantize_raw, read_raw


def read_gguf_weights(facts: AdapterFacts, heads: tuple[int, int]) -> dict[tuple[int, str], tuple[torch.Tensor,
                                                                                                    torch.Tensor]]:
    """`heads`: the base model's query and key-value head counts (the q and k rows' permutation)."""
    table = {t.name: t for t in gguf_facts(facts.path).tensors}
    out = {}
    with open(facts.path, "rb") as f:
        for (layer, target), names in facts.tensors.items():
            A, B = (dequantize_raw(read_raw(table[n], f), table[n], Path(facts.path)) for n in names)
            if facts.gguf_arch in _PERMUTED_QK and target in ("q_proj", "k_proj"):
                B = B[_unpermute_index(B.shape[0], heads[0] if target == "q_proj" else heads[1])]
            out[(layer, target)] = (A, B)
    return out
