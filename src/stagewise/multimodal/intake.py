"""The server's side of images: the vision encoder of a vision-language checkpoint, built at start-up,
and the two things the chat routes ask of it: a collector for a request's image parts (`parts`) and
the prompt those parts make once the conversation is rendered (`prompt`). Its two bounded pools keep
image work off the threads text requests use: downloads (`fetchers`, each bounded in time) and
decoding, resizing and encoding (`decoders`; each image bounded in pixels before it is decoded)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .images import ImageLimits

DECODE_THREADS = 2          # images decoded and encoded at once: each is bounded, so memory is too
FETCH_THREADS = 8           # downloads at once; each ends by --image-fetch-timeout-s
MAX_PENDING = 32            # image requests waiting for the pools; more get 503


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
        self.limits = self.encoder.limits
        self.decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="stagewise-images")
        self.fetchers = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="stagewise-fetch")
        self.pending = 0            # image requests in the pools (event loop only)

    def parts(self) -> ImageParts:
        return ImageParts(self.token)

    def prompt(self, text: str, parts: ImageParts):
        """The rendered conversation and its images -> a prompt of embeddings (ImageError on a bad image)."""
        from ..core.client import PromptInput
        images = self.encoder.load_images(list(parts))
        return PromptInput(input_embeds=self.encoder.from_text(self.tok, text, images).input_embeds)

    def fetch(self, source, where: str) -> bytes:
        from .fetch import fetch
        return fetch(source, self.limits, where)

    def close(self) -> None:
        for pool in (self.decoders, self.fetchers):
            pool.shutdown(wait=False, cancel_futures=True)

    def count(self, token_ids: list[int]) -> list[int]:
        """Token ids with every image expanded to its feature tokens (for /tokenize)."""
        return self.encoder.expand(token_ids)


def image_intake(model_dir: str, tok: Any, limits: ImageLimits | None) -> ImageIntake | None:
    """The intake of a vision-language checkpoint; None for a text-only model."""
    facts = getattr(tok, "facts", None)          # None: a stand-in tokenizer
    if getattr(getattr(facts, "config", None), "multimodal_config", None) is None:
        return None
    return ImageIntake(model_dir, tok, limits or ImageLimits())
