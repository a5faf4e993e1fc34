"""Helpers of the multimodal tests: the tiny LLaVA builder, seeded images, data URLs and the
transformers oracle."""
from __future__ import annotations

import base64
import functools
import io
from pathlib import Path

import torch

IMAGE_SIZE = 56


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with std 0.2 (norm scales 1 +- 0.1), as the text families' tests draw them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_scale = param.dim() == 1 and name.endswith("weight")
            param.copy_(1.0 + 0.1 * noise if is_scale else (0.1 if param.dim() == 1 else 0.2) * noise)



def build_tiny_llava(out_dir: Path, tokenizer_dir: Path, seed: int = 0, tower: str = "clip") -> Path:
    """`tower`: "clip" (CLS dropped: the 'default' strategy) or "siglip" (every patch: 'full')."""
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<image>"], special_tokens=True)
    tok.save_pretrained(out_dir)
    image_id = tok.convert_tokens_to_ids("<image>")
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 image_size=IMAGE_SIZE, patch_size=14)
    vision = tf.CLIPVisionConfig(projection_dim=32, **shape) if tower == "clip" else tf.SiglipVisionConfig(**shape)
    text = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                            vision_feature_layer=-2,
                            vision_feature_select_strategy="default" if tower == "clip" else "full",
                            image_seq_length=(IMAGE_SIZE // 14) ** 2)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).float().eval()
    _redraw(model, seed)
    model.save_pretrained(out_dir)
    tf.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out_dir)
    return out_dir


def make_image(seed: int, size: tuple[int, int] = (64, 48)):
    """A small RGB image with seeded random pixels."""
    from PIL import Image
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@functools.lru_cache(maxsize=None)
def _hf_llava(model_dir: str):
    from transformers import LlavaForConditionalGeneration
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


def hf_llava_greedy(model_dir, token_ids: list[int], pixel_values, max_new_tokens: int) -> list[int]:
    """transformers' generate on the expanded prompt ids and the processor's pixel values."""
    model, ids = _hf_llava(str(model_dir)), torch.tensor([token_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values,
                             do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(token_ids):].tolist()



def png_bomb(width: int, height: int) -> bytes:
    """A valid-looking PNG header claiming `width` x `height` pixels with a few bytes of data: decoding it
    would allocate width * height * 3 bytes; a bounded decoder refuses it from the header."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def raw_data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def build_tiny_idefics3(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Idefics3 (SmolVLM's architecture): 56x56 tiles in 14-pixel patches, pixel shuffle by 2 -> 4 image
    tokens per image (no splitting), 2-layer Llama text model, hidden 64."""
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<image>", "<fake_token_around_image>", "<global-img>"], special_tokens=True)
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=IMAGE_SIZE, patch_size=14)
    text = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = tf.Idefics3Config(vision_config=vision, text_config=text,
                               image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    torch.manual_seed(seed)
    model = tf.Idefics3ForConditionalGeneration(config).float().eval()
    _redraw(model, seed)
    model.save_pretrained(out_dir)
    images = tf.Idefics3ImageProcessor(size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
                                       do_image_splitting=False)
    tf.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def hf_idefics3_greedy(model_dir, batch: dict, max_new_tokens: int) -> list[int]:
    """transformers' generate on the processor's output (ids, pixel values and pixel mask)."""
    from transformers import Idefics3ForConditionalGeneration
    model = Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    ids = batch["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=batch["pixel_values"],
                             pixel_attention_mask=batch["pixel_attention_mask"], do_sample=False,
                             max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1]:].tolist()
