"""Architecture name (config.json `architectures[0]`) -> stage model class.

Built-in families are registered at import; `register_model` adds or replaces one.
"""
from __future__ import annotations

from stagewise.model.gpt2 import GPT2LMHeadModel
from stagewise.model.gpt_oss import GptOssForCausalLM
from stagewise.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from stagewise.model.llama_dense import (
    Gemma3ForCausalLM,
    GraniteForCausalLM,
    Olmo2ForCausalLM,
    Phi3ForCausalLM,
    SmolLM3ForCausalLM,
)
from stagewise.model.llama_moe import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from stagewise.model.qwen3_5 import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
from stagewise.model.vlm import Idefics3ForConditionalGeneration, LlavaForConditionalGeneration

_MODELS: dict[str, type] = {}


def register_model(architecture: str, cls: type) -> None:
    """Make `cls` the stage model for `architecture`. It must follow the stage-model contract:
    `cls(hf_config, stage, dtype)`, forward / compute_logits / embed_tokens / load_weights / ..."""
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"Architecture name must be a non-empty string, got {architecture!r}.")
    if not isinstance(cls, type):
        raise ValueError(f"register_model({architecture!r}, ...) needs a class, got {type(cls).__name__}.")
    _MODELS[architecture] = cls


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"Model architecture {architecture!r} is not supported; supported architectures: "
                         f"{', '.join(supported_architectures())}. Register one with register_model().")
    return _MODELS[architecture]


def registered_models() -> dict[str, type]:
    """The classes a stage process can import by reference; stage processes re-register them,
    so user models work under PP. (A class defined inside a function cannot travel.)"""
    return {arch: cls for arch, cls in _MODELS.items() if _importable(cls)}


def _importable(cls: type) -> bool:
    """Whether another process finds `cls` by its module and qualified name."""
    import importlib
    import sys
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__" and not hasattr(sys.modules["__main__"],
                                                                                       "__file__"):
        return False
    try:
        found: object = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is cls


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


for _cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
             Qwen2MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, SmolLM3ForCausalLM, Olmo2ForCausalLM,
             GraniteForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM, GPT2LMHeadModel,
             Qwen3_5ForCausalLM, Qwen3NextForCausalLM, LlavaForConditionalGeneration, Idefics3ForConditionalGeneration):
    register_model(_cls.__name__, _cls)
