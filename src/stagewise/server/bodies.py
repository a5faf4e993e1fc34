"""Whole (non-stream) response bodies written in pieces: a body with many logprob entries is sent
choice by choice instead of being built whole, and what the choices of one prompt share (its echoed
entries, its vLLM `prompt_logprobs`) is serialized once and spliced into each as JSON text.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

PIECE_CHARS = 1 << 16         # pieces smaller than this are joined before they are sent


def dumps(obj: Any) -> str:
    """The encoding JSONResponse uses (compact, UTF-8 as is, no NaN)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class Splicer:
    """Puts already-serialized JSON values into an object as it is serialized. The markers carry a
    random token, so no text a client sent can be mistaken for one."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex

    def dumps(self, obj: dict, raw: dict[str, str]) -> str:
        markers = {key: f"\x00{self.token}:{key}" for key in raw}
        text = dumps(dict(obj, **markers))
        for key, marker in markers.items():
            text = text.replace(dumps(marker), raw[key], 1)
        return text


def list_items(values: list) -> str:
    """A list's JSON without its brackets, to be joined with another's."""
    return dumps(values)[1:-1]


def joined_lists(first: dict[str, str], second: dict[str, list]) -> str:
    """The object {key: first[key] + second[key]}, with `first` already serialized by `list_items`."""
    parts = []
    for key, items in first.items():
        tail = list_items(second[key])
        parts.append(f"{dumps(key)}:[{items}{',' if items and tail else ''}{tail}]")
    return "{" + ",".join(parts) + "}"


def body_pieces(head: dict, key: str, items: Iterator[str]) -> Iterator[bytes]:
    """`head` with `key` (a list) filled from `items` (each one element's JSON), in pieces."""
    marker = f"\x00{uuid.uuid4().hex}"
    before, after = dumps(dict(head, **{key: marker})).split(dumps(marker), 1)
    buffer, size = [before, "["], 0
    for k, item in enumerate(items):
        buffer.append("," + item if k else item)
        size += len(item)
        if size >= PIECE_CHARS:
            yield "".join(buffer).encode()
            buffer, size = [], 0
    buffer += ["]", after]
    yield "".join(buffer).encode()
