"""stagewise: a compact LLM inference engine built around pipeline parallelism with captured prefill graphs."""
from .config import EngineConfig
from .llm import LLM
from .model.registry import register_model
from .request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "register_model"]
