"""Idefics3 (SmolVLM's architecture): a SigLIP-style tower, a pixel-shuffle connector and a Llama
text model. The checkpoint's own processor (transformers' `Idefics3Processor`) resizes, splits and
pads the images and expands each `<image>` in the rendered prompt into its tokens; the tower and
connector (transformers' modules, the checkpoint's weights) give one feature row per image token."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from .encoder import ImagePrompt, VisionEncoder, _load, image_hash
from .images import ImageError, ImageLimits
from .messages import split_images


class Idefics3Encoder(VisionEncoder):
    # NOTE: VisionEncoder.__init__ is not called: this encoder sets its own fields
    def __init__(self, model_dir: str | Path, limits: ImageLimits | None = None):
        from transformers import AutoConfig, AutoProcessor
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer
        self.config = cfg = AutoConfig.from_pretrained(str(model_dir))
        self.limits = limits or ImageLimits()
        self.image_token_id = int(cfg.image_token_id)
        try:
            self.full_processor = AutoProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir} has no usable Idefics3 processor (processor_config.json): {exc}") from exc
        self.processor = self.full_processor.image_processor
        self.tower = Idefics3VisionTransformer(cfg.vision_config).float().eval()
        self.projector = Idefics3Connector(cfg).float().eval()
        self.embed_weight = _load(self, Path(model_dir), _target)
        self._lock = threading.Lock()

    @property
    def tokens_per_image(self) -> int:
        return int(self.full_processor.image_seq_len)

    def expand(self, token_ids: list[int]) -> list[int]:
        """Each `<image>` as the processor writes an unsplit image; a splitting processor needs the images."""
        if getattr(self.processor, "do_image_splitting", False):
            raise ImageError("This model splits images into tiles, so its image token count depends on each "
                             "image's size; send the request to count them.", "messages")
        proc, out = self.full_processor, []
        tok = proc.tokenizer
        fake, glob = tok.convert_tokens_to_ids(proc.fake_image_token), tok.convert_tokens_to_ids(proc.global_image_tag)
        for t in token_ids:
            out.extend([fake, glob, *[t] * self.tokens_per_image, fake] if t == self.image_token_id else [t])
        return out

    def tile_features(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """Processor output (one prompt) -> connector features `[tiles, tokens per tile, H]`, as
        transformers' `Idefics3Model.get_image_features` computes them."""
        pv, mask = pixel_values[0].float(), pixel_mask[0]
        real = (pv == 0.0).sum(dim=(-1, -2, -3)) != pv[0].numel()       # padding tiles are all zeros
        pv, mask = pv[real].contiguous(), mask[real].contiguous()
        ps = self.config.vision_config.patch_size
        patch_mask = mask.unfold(1, ps, ps).unfold(2, ps, ps).sum(dim=(-1, -2)) > 0
        with self._lock, torch.inference_mode():
            hidden = self.tower(pixel_values=pv, patch_attention_mask=patch_mask).last_hidden_state
            return self.projector(hidden)

    def chat(self, tok, messages: list[dict], **template_kwargs) -> ImagePrompt:
        flat, sources = split_images(messages, self.full_processor.image_token)
        return self.from_text(tok, tok.chat_prompt(flat, **template_kwargs), self.load_images(sources))

    def from_text(self, tok, text: str, images: list) -> ImagePrompt:
        batch = self.full_processor(text=[text], images=[images] if images else None, return_tensors="pt")
        ids = batch["input_ids"][0].tolist()
        embeds = self.embed_weight[torch.tensor(ids)].clone()      # [T, H]
        num = 0
        if images:
            feats = self.tile_features(batch["pixel_values"], batch["pixel_attention_mask"])
            rows = torch.tensor(ids) == self.image_token_id
            if int(rows.sum()) != feats.shape[0] * feats.shape[1]:
                raise ImageError("The prompt's image tokens do not match the image features; put each image in "
                                 "its own content part and no image token in the text.", "messages")
            embeds[rows] = feats.reshape(-1, feats.shape[-1])
            num = int(rows.sum())
        return ImagePrompt(ids, embeds, num, [image_hash(im) for im in images])

    def processed(self, tok, messages: list[dict]) -> dict:
        """The processor's output for a conversation (the tests' transformers oracle reads it)."""
        flat, sources = split_images(messages, self.full_processor.image_token)
        images = self.load_images(sources)
        return self.full_processor(text=[tok.chat_prompt(flat)], images=[images], return_tensors="pt")


def _target(name: str, tower: dict) -> str | None:
    if name == "text_model.embed_tokens.weight":
        return "embed"
    if name.startswith("connector."):
        return "p:" + name.removeprefix("connector.")
    if name.startswith("vision_model."):
        return "t:" + name.removeprefix("vision_model.")
    return None
