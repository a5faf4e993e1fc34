"""stagewise: a compact LLM inference engine built around pipeline parallelism with captured prefill graphs."""
import sys as _sys

from .graph import compile_cache as _compile_cache
from .runtime import threads as _threads

# NOTE: before anything imports torch: OpenMP reads its wait policy once, when torch loads it, and
# importing torch._inductor fills TORCHINDUCTOR_CACHE_DIR with torch's own default.
_threads.set_wait_default(openmp_started="torch" in _sys.modules)
_compile_cache.claim()

from .config import EngineConfig  # noqa: E402
from .llm import LLM  # noqa: E402
from .model.registry import register_model  # noqa: E402
from .request import RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "register_model"]
