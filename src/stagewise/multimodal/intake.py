"""The server's side of images: the vision encoder of a vision-language checkpoint, built at start-up,
and the two things the chat routes ask of it: a collector for a request's image parts (`parts`) and
the prompt those parts make once the conversation is rendered (`prompt`)."""
from __future__ import annotations

from typing import Any

from .images import ImageLimits


class ImageParts(list):
    """A request's image parts in order, [(source, where)]; `token` is the text each stands for."""

    def __init__(self, token: str):
        super().__init__()
        self.token = token


class ImageIntake:
    def __init__(self, model_dir: str, tok: Any, limits: ImageLimits):
        from .families import vision_encoder  # torch: imported only for a vision-language model
        self.encoder = vision_encoder(model_dir, limits)
        self.tok = tok
        self.token = tok.tokenizer.convert_ids_to_tokens(self.encoder.image_token_id)

    def parts(self) -> ImageParts:
        return ImageParts(self.token)

    def prompt(self, text: str, parts: ImageParts):
        """The rendered conversation and its images -> a prompt of embeddings (ImageError on a bad image)."""
        from ..core.client import PromptInput
        images = self.encoder.load_images(list(parts))
        return PromptInput(input_embeds=self.encoder.from_text(self.tok, text, images).input_embeds)

    def count(self, token_ids: list[int]) -> list[int]:
        """Token ids with every image expanded to its feature tokens (for /tokenize)."""
        return self.encoder.expand(token_ids)


def image_intake(model_dir: str, tok: Any, limits: ImageLimits | None) -> ImageIntake | None:
    """The intake of a vision-language checkpoint; None for a text-only model."""
    if getattr(getattr(tok, "hf_config", None), "multimodal_config", None) is None:   # or a stand-in tokenizer
        return None
    return ImageIntake(model_dir, tok, limits or ImageLimits())
