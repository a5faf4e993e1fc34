"""Request schemas (OpenAI completions and chat, native /generate) and their mapping to
SamplingParams. Types are strict: a string where a number belongs is a 400, not a coercion.

Unknown fields are refused ("Unrecognized request argument"), as OpenAI does; known fields
whose values would change results but are not implemented are refused by `check_unsupported`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..request import SamplingParams
from .errors import bad_request, from_value_error

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's documented default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """OpenAI sampling fields plus the engine's extensions (top_k, min_p, ...)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                         # accepted and ignored, as an end-user tag

    def sampling_kwargs(self) -> dict:
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                 "skip_special_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def check_common(self) -> None:
        if not isinstance(self.n, int) or self.n < 1 or self.n > 16:
            raise bad_request(f"n must be an integer in [1, 16], got {self.n!r}.", "n")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server; remove it.", "logit_bias", "unsupported")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n); remove it.", "best_of", "unsupported")
        if self.echo:
            raise bad_request("echo is not supported by this server; set it to false.", "echo", "unsupported")
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported by this server; remove it.", "suffix", "unsupported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None

    def as_template_dict(self, i: int) -> dict:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content holds a {part.get('type')!r} part; this server "
                                      f"accepts only text parts.", f"messages.{i}.content", "unsupported")
                texts.append(part["text"])
            content = "".join(texts)
        # NOTE: few chat templates know the "developer" role; it means system.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    functions: list[dict] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    # accepted and ignored: they tag or route requests, they do not change outputs
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def check_unsupported(self) -> None:
        self.check_common()
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise bad_request(f"{name} (function calling) is not supported by this server; remove it.", name, "unsupported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise bad_request(f"{name} is not supported by this server; remove it.", name, "unsupported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("Only response_format {\"type\": \"text\"} is supported; remove response_format.",
                              "response_format", "unsupported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("Give max_tokens or max_completion_tokens, not both with different values.",
                              "max_completion_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateRequest(_Strict):
    """Native API: one prompt as text, token ids or embeddings [T][H]; SamplingParams fields verbatim."""
    text: str | None = None
    input_ids: list[int] | None = None
    input_embeds: list[list[float]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    model: str | None = None

    def check(self) -> None:
        given = [k for k in ("text", "input_ids", "input_embeds") if getattr(self, k) is not None]
        if len(given) != 1:
            raise bad_request("Give exactly one of text, input_ids or input_embeds.", given[1] if given else "text")


def make_sampling_params(fields: dict, max_tokens: int, logprobs: int | None, seed_offset: int = 0
                         ) -> SamplingParams:
    """SamplingParams from validated fields; its own checks (ranges) become 400s naming the field."""
    kwargs = dict(fields, max_tokens=max_tokens, logprobs=logprobs)
    if seed_offset and kwargs.get("seed") is not None:
        kwargs["seed"] += seed_offset          # n > 1 with a seed: distinct but reproducible choices
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_value_error(exc) from None


def native_sampling_fields(raw: dict) -> dict:
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise bad_request(f"Unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.",
                          f"sampling_params.{unknown[0]}")
    return dict(raw)
