"""`/v1/embeddings`: OpenAI's request (`input` as text, texts, token ids or lists of them;
`encoding_format` float or base64; `dimensions`) and response. Each input is one engine request
(SamplingParams.embed): a prefill through the pipeline whose last stage pools the final-normed
hidden state; the vectors come back L2-normalised."""
from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import Response

from ..core.client import PromptInput
from ..request import RequestOutput, SamplingParams
from .errors import bad_request
from .formatting import Shape
from .intake import parse_request
from .protocol import _FAST, Int, Strs, TokenIds, _Strict
from .routes import Job, _ids_input, _serve
from .serving import Serving


class EmbeddingRequest(_Strict):
    input: str | Strs | TokenIds | Annotated[list[TokenIds], _FAST]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None


async def embeddings(serving: Serving, raw: Request) -> Response:
    return await _serve(serving, raw, embedding_job)


def embedding_job(serving: Serving, body: bytes) -> Job:
    req = parse_request(body, EmbeddingRequest)
    serving.check_model(req.model)
    size = int(serving.tok.hidden_size)
    # NOTE: a decoder's hidden state is not trained to be cut short (Matryoshka): a shorter vector
    # would be a different, untested embedding, so only the full size is accepted
    if req.dimensions is not None and req.dimensions != size:
        raise bad_request(f"dimensions must be {size} for this model (its embeddings are not trained to be "
                          f"truncated); remove dimensions or set it to {size}.", "dimensions")
    inputs = _inputs(serving, req.input)
    params = [SamplingParams(max_tokens=0, embed=True, **serving.adapter(req.model)) for _ in inputs]
    return Job(inputs, params, EmbeddingShape(serving, req.encoding_format), stream=False)


def _inputs(serving: Serving, given) -> list[PromptInput]:
    if isinstance(given, str):
        items, names = [given], ["input"]
    elif not given:
        raise bad_request("input is empty; give a string, a list of strings or a list of token ids.", "input")
    elif isinstance(given[0], int):
        items, names = [given], ["input"]
    else:
        items, names = given, [f"input[{i}]" for i in range(len(given))]
    serving.check_choices(len(items), 1)
    limit = min(serving.max_model_len, serving.kv_capacity_tokens) - 1     # the engine keeps one place free
    prompts = []
    for item, name in zip(items, names):
        prompt = serving.text_input(item, name) if isinstance(item, str) else _ids_input(serving, item, name)
        if prompt.num_tokens > limit:
            raise bad_request(f"{name} has {prompt.num_tokens} tokens, more than this server embeds at once "
                              f"({limit}); shorten it.", "input", "context_length_exceeded")
        prompts.append(prompt)
    return prompts


class EmbeddingShape(Shape):
    """The whole response: one `embedding` object per input, in input order."""

    def __init__(self, serving: Serving, encoding_format: str):
        super().__init__(serving, None, "embd")
        self.base64 = encoding_format == "base64"

    def body(self, inputs: list[PromptInput], finals: list[RequestOutput]) -> dict:
        data = [{"object": "embedding", "index": i, "embedding": self.encoded(out.embedding or [])}
                for i, out in enumerate(finals)]
        tokens = sum(p.num_tokens for p in inputs)
        return {"object": "list", "data": data, "model": self.serving.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def encoded(self, vector: list[float]) -> list[float] | str:
        # OpenAI's client decodes base64 as little-endian float32 (numpy's "float32" on every host it runs on)
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode() if self.base64 else vector
