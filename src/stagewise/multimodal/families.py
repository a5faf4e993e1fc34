"""Which vision encoder a checkpoint needs: LLaVA's (encoder.py) or Idefics3's (idefics3.py)."""
from __future__ import annotations

from pathlib import Path

from .encoder import VisionEncoder
from .idefics3 import Idefics3Encoder
from .images import ImageLimits


def vision_encoder(model_dir: str | Path, limits: ImageLimits | None = None) -> VisionEncoder:
    """The encoder of a checkpoint's family: LLaVA, or Idefics3 (SmolVLM's architecture)."""
    from transformers import AutoConfig
    if getattr(AutoConfig.from_pretrained(str(model_dir)), "model_type", "") == "idefics3":
        return Idefics3Encoder(model_dir, limits)
    return VisionEncoder(model_dir, limits)
