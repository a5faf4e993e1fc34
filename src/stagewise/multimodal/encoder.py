"""The vision encoder in the driver: a LLaVA checkpoint's vision tower and projector (transformers'
own modules with the checkpoint's weights) and its image processor turn images into features,
spliced into the prompt's token embeddings at the image-token positions. The result is an ordinary
`input_embeds` prompt, so the stages, the pipeline and the graphs treat it as any embedding prompt.

Why in the driver and not on the first stage: the step plan already carries a request's prompt
embeddings to the first stage, so no stage, partition or memory plan changes; the tower runs once
per image at intake, never inside a captured step; and the driver holds the request, so a bad
image is refused (a 400) before any stage is touched. The cost: the driver holds the tower, the
projector and a copy of the token-embedding matrix.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .images import ImageError, ImageLimits, load_image
from .messages import split_images


@dataclass
class ImagePrompt:
    token_ids: list[int]        # the prompt with each image expanded to its feature tokens
    input_embeds: torch.Tensor  # [T, H] token embeddings, image rows replaced by image features
    num_image_tokens: int
    image_hashes: list[str]     # sha256 of each image's RGB pixels and size


class VisionEncoder:
    """`VisionEncoder(model_dir)`: images -> prompt embeddings for one vision-language checkpoint."""

    def __init__(self, model_dir: str | Path, limits: ImageLimits | None = None):
        from transformers import AutoConfig, AutoImageProcessor, AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        self.config = cfg = AutoConfig.from_pretrained(str(model_dir))
        if getattr(cfg, "vision_config", None) is None:
            raise ValueError(f"{model_dir} is not a vision-language checkpoint (its config has no vision_config); "
                             f"send text only.")
        self.limits = limits or ImageLimits()
        self.image_token_id = int(getattr(cfg, "image_token_id", None) or cfg.image_token_index)
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir} has no usable image processor (preprocessor_config.json): {exc}") from exc
        self.tower: torch.nn.Module = AutoModel.from_config(cfg.vision_config).float().eval()
        self.projector: torch.nn.Module = LlavaMultiModalProjector(cfg).float().eval()
        self.embed_weight = _load(self, Path(model_dir))
        self._lock = threading.Lock()      # the server encodes from several threads

    @property
    def tokens_per_image(self) -> int:
        """Feature rows of one image: the tower's rows (patches, plus CLIP's CLS), less the first under the
        'default' strategy (transformers' LLaVA drops it)."""
        vc = self.config.vision_config
        has_cls = any(k.endswith("class_embedding") for k in self.tower.state_dict())     # CLIP yes, SigLIP no
        grid = (vc.image_size // vc.patch_size) ** 2
        return grid + int(has_cls) - int(self.config.vision_feature_select_strategy == "default")

    def expand(self, token_ids: list[int]) -> list[int]:
        """The prompt ids with each image token repeated `tokens_per_image` times (no image decoded)."""
        out: list[int] = []
        for t in token_ids:
            out.extend([t] * self.tokens_per_image if t == self.image_token_id else [t])
        return out

    def load_images(self, sources: list[tuple]) -> list:
        """[(source, where)] -> RGB images, each under the limits (ImageError naming its part)."""
        if len(sources) > self.limits.max_images:
            raise ImageError(f"The request has {len(sources)} images, over the limit of {self.limits.max_images} "
                             f"(--max-images-per-request).", "messages")
        return [load_image(src, self.limits, where, self.processor) for src, where in sources]

    @property
    def hidden_size(self) -> int:
        return int(self.embed_weight.shape[1])

    def image_features(self, images: list) -> torch.Tensor:
        """RGB PIL images -> projected features `[N, tokens per image, H]` (float32)."""
        cfg = self.config
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].float()
        with self._lock, torch.inference_mode():
            out = self.tower(pixels, output_hidden_states=True, return_dict=True)
            layers = cfg.vision_feature_layer
            pool = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
            if cfg.vision_feature_select_strategy == "default":   # drop the CLS position
                pool = [h[:, 1:] for h in pool]
            return self.projector(torch.cat(pool, dim=-1))

    def pixel_values(self, images: list) -> torch.Tensor:
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def encode(self, token_ids: list[int], images: list) -> ImagePrompt:
        """Token ids holding one image token per image -> the expanded prompt and its embeddings."""
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise ImageError(f"The prompt holds {len(positions)} image placeholders for {len(images)} images; "
                             f"put each image in its own content part and no image token in the text.", "messages")
        if len(images) > self.limits.max_images:
            raise ImageError(f"The request has {len(images)} images, over the limit of {self.limits.max_images} "
                             f"(--max-images-per-request).", "messages")
        feats = self.image_features(images) if images else None     # [N, n, H]
        n = 0 if feats is None else int(feats.shape[1])
        ids: list[int] = []
        for t in token_ids:
            ids.extend([t] * n if t == self.image_token_id else [t])
        embeds = self.embed_weight[torch.tensor(ids)].clone()      # [T, H]
        if feats is not None:
            embeds[torch.tensor(ids) == self.image_token_id] = feats.reshape(-1, feats.shape[-1]).to(embeds.dtype)
        return ImagePrompt(ids, embeds, n * len(images), [image_hash(im) for im in images])

    def chat(self, tok, messages: list[dict], **template_kwargs) -> ImagePrompt:
        """A conversation with image parts -> its prompt (`tok`: the engine's `Tokenizer`)."""
        flat, sources = split_images(messages, tok.tokenizer.convert_ids_to_tokens(self.image_token_id))
        images = self.load_images(sources)
        return self.from_text(tok, tok.chat_prompt(flat, **template_kwargs), images)

    def from_text(self, tok, text: str, images: list) -> ImagePrompt:
        """A rendered prompt holding one image token per image, and the decoded images -> its prompt."""
        return self.encode(tok.encode(text), images)


def image_hash(image) -> str:
    """The content key of an image (its decoded pixels), e.g. for a prefix cache keyed by images."""
    return hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()


def _load(enc: VisionEncoder, model_dir: Path, target=None) -> torch.Tensor:
    """Copy the tower and projector weights in; return the token-embedding matrix (float32).
    `target(name, tower state dict)`: the checkpoint name's slot ("embed", "t:<tower key>", "p:<projector key>")."""
    from safetensors import safe_open

    from ..model.loader import tensor_locations
    tower, proj = enc.tower.state_dict(), enc.projector.state_dict()
    targets = {**{f"t:{k}": v for k, v in tower.items()}, **{f"p:{k}": v for k, v in proj.items()}}
    embed = None
    for name, fpath in tensor_locations(model_dir).items():
        key = (target or _target)(name.removeprefix("model."), tower)
        if key is None:
            continue
        with safe_open(str(fpath), framework="pt", device="cpu") as f:
            tensor = f.get_tensor(name)
        if key == "embed":
            embed = tensor.float()
        elif key in targets:
            if tuple(tensor.shape) != tuple(targets[key].shape):
                raise ValueError(f"Checkpoint tensor {name} has shape {tuple(tensor.shape)}, but the vision config "
                                 f"implies {tuple(targets[key].shape)}.")
            targets.pop(key).copy_(tensor)
    if targets or embed is None:
        missing = next(iter(targets), "the token embedding")
        raise ValueError(f"{model_dir} lacks the vision weight {missing.split(':', 1)[-1]}; "
                         f"the checkpoint does not match its config.json.")
    return embed


def _target(name: str, tower: dict) -> str | None:
    if name in ("language_model.model.embed_tokens.weight", "language_model.embed_tokens.weight"):
        return "embed"
    if name.startswith("multi_modal_projector."):
        return "p:" + name.removeprefix("multi_modal_projector.")
    if name.startswith("vision_tower."):
        rest = name.removeprefix("vision_tower.")
        for cand in (rest, rest.removeprefix("vision_model."), "vision_model." + rest):
            if cand in tower:
                return "t:" + cand
        return "t:" + rest
    return None
