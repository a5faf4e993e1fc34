"""Vision-language checkpoints as pipeline stages: the text model of a LLaVA-style checkpoint.

The stages run only the language model; the vision tower and projector run in the driver
(`stagewise.multimodal`), whose image features reach the first stage as prompt embeddings.
So a stage loads `language_model.*` tensors and skips `vision_tower.*` / `multi_modal_projector.*`.
"""
from __future__ import annotations

from stagewise.model.llama import LlamaForCausalLM

_TEXT_PREFIX = "language_model.model."
_HEAD = "language_model.lm_head.weight"


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA (transformers' `LlavaForConditionalGeneration`) with a Llama/Mistral/Qwen2 text model.
    `hf_config` is the text view `checkpoint.files.load_hf_config` returns for a vision-language checkpoint."""

    @staticmethod
    def attention_biases(hf_config) -> tuple[bool, bool]:
        if getattr(hf_config, "model_type", "") == "qwen2":
            return True, False
        return LlamaForCausalLM.attention_biases(hf_config)

    def hf_name(self, param_name: str) -> str:
        if param_name.startswith("lm_head."):
            return _TEXT_PREFIX + "embed_tokens.weight" if self.tie_word_embeddings else _HEAD
        return _TEXT_PREFIX + param_name

    def canonical_name(self, hf_name: str) -> str:
        """Both spellings transformers has saved: `language_model.model.X` / `language_model.lm_head`
        (LLaVA 1.5 on the Hub) and `model.language_model.X` / `lm_head` (transformers >= 4.52 layout)."""
        if hf_name.startswith("model.language_model."):
            return _TEXT_PREFIX + hf_name.removeprefix("model.language_model.")
        if hf_name == "lm_head.weight":
            return _HEAD
        return hf_name


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """Idefics3 (SmolVLM's architecture): a Llama text model under `model.text_model.*`."""

    def hf_name(self, param_name: str) -> str:
        if param_name.startswith("lm_head."):
            return "model.text_model.embed_tokens.weight" if self.tie_word_embeddings else param_name
        return "model.text_model." + param_name
