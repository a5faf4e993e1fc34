"""Chat messages whose `content` is a list of parts (OpenAI's shape): text parts are joined, each
image part becomes the model's image placeholder token in the text, and the images are collected in
order with the name of the part they came from (`messages[0].content[1]`)."""
from __future__ import annotations

from typing import Any

from .images import ImageError

IMAGE_PART_TYPES = ("image_url", "image")


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
               for m in messages)


def split_images(messages: list[dict], image_token: str) -> tuple[list[dict], list[tuple[Any, str]]]:
    """(messages with string contents, [(image source, where)]). An image part's source is its
    `image_url.url` (or `image_url` as a string), or for `{"type": "image", "image": ...}` a PIL image,
    bytes or URL."""
    flat: list[dict] = []
    images: list[tuple[Any, str]] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            flat.append(msg)
            continue
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ImageError(f"{where} is a text part without a string 'text'.", where)
                texts.append(part["text"])
            elif kind in IMAGE_PART_TYPES:
                images.append((_source(part, kind, where), where))
                texts.append(image_token)
            else:
                raise ImageError(f"{where} has type {kind!r}; content parts must be 'text' or 'image_url'.", where)
        flat.append({**msg, "content": "".join(texts)})
    return flat, images


def _source(part: dict, kind: str, where: str) -> Any:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if value is None:
        raise ImageError(f"{where} is an {kind} part without an image ({kind}.url).", where)
    return value
