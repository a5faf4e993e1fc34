"""Request schemas (OpenAI completions and chat, native /generate) and their mapping to
SamplingParams. Types are strict: a string where a number belongs is a 400, not a coercion.

`SamplingFields` is the one schema of SamplingParams' fields: /generate takes it (plus
`logprobs`) as `sampling_params`, and the OpenAI schemas inherit it. The OpenAI schemas take
vLLM's extensions too, and ignore unknown fields as vLLM does (one warning line per field
name, `_Lenient`); /generate refuses them ("Unrecognized request argument"). Known fields
whose values would change results but are not implemented are refused by `check_unsupported`. Validating a
hostile body costs about as much as parsing it: lists stop at their first bad item, dicts
are bounded, and only the first unknown key is reported.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from ..request import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutputs,
)
from .errors import bad_request, from_value_error

log = logging.getLogger("stagewise.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's documented default for /v1/completions
MAX_N = 16                           # choices per prompt
MAX_MAP_ITEMS = 64                   # entries of metadata / logit_bias


def _at_most(n: int):
    def check(value):
        if isinstance(value, (dict, list)) and len(value) > n:
            raise ValueError(f"at most {n} entries are allowed, got {len(value)}")
        return value
    return BeforeValidator(check)


_FAST = Field(fail_fast=True)                                     # stop at a list's first bad item
Int = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]             # fits the engine's int64 tensors
Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenIds = Annotated[list[int], _FAST]           # unbounded ints: the engine checks them against the vocabulary
Strs = Annotated[list[str], _FAST]
def _short_items(value):
    """Each stop string within the engine's limit, named by its index (the engine's own check says
    only how many strings the list has)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str) and len(item) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop[{i}] has {len(item)} characters, more than the limit of "
                                 f"{MAX_STOP_STRING_CHARS}")
    return value


StopStrs = Annotated[list[str], _FAST, _at_most(MAX_STOP_STRINGS), BeforeValidator(_short_items)]
Anys = Annotated[list[Any], _FAST]                                  # items checked where used
StopTokenIds = Annotated[list[Int], _FAST, _at_most(MAX_STOP_TOKEN_IDS)]
FloatRows = Annotated[list[Annotated[list[Finite], _FAST]], _FAST]


def validate_each(value, handler: ValidatorFunctionWrapHandler, model: type[BaseModel]) -> list:
    """A list of models validated one item at a time in Python, so 100k of them never hold the GIL
    in one stretch (the event loop keeps answering); the first bad item is reported with its index."""
    if not isinstance(value, list) or not value:
        return handler(value)
    items = []
    for i, item in enumerate(value):
        try:
            items.append(model.model_validate(item))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            raise ValidationError.from_exception_data(exc.title, [
                {"type": err["type"], "loc": (i, *err["loc"]), "input": err["input"], **_ctx(err)}]) from None
    return items


def _ctx(err) -> dict:
    return {"ctx": err["ctx"]} if "ctx" in err else {}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_key_only(cls, data):
        # NOTE: extra="forbid" reports every unknown key, and 400k of them take seconds; one is enough.
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            unknown = next((k for k in data if k not in cls.model_fields), None)
            if unknown is not None:
                return {k: v for k, v in data.items() if k in cls.model_fields or k == unknown}
        return data


MAX_WARNED_FIELDS = 256              # distinct unknown field names logged, at most (a client can invent many)
_warned_fields: set[str] = set()
_warned_lock = threading.Lock()


def warn_unknown_field(schema: str, name: str) -> None:
    """One warning line per unknown field name (per process), as vLLM logs them."""
    with _warned_lock:
        if name in _warned_fields or len(_warned_fields) >= MAX_WARNED_FIELDS:
            return
        _warned_fields.add(name)
    log.warning("%s: ignoring the unknown request field %r (logged once per field name)", schema, name[:100])


class _Lenient(_Strict):
    """vLLM's rule for its OpenAI schemas: unknown fields are dropped, with one warning per name."""
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_key_only(cls, data):
        if isinstance(data, dict) and any(k not in cls.model_fields for k in data):
            for k in data:
                if k not in cls.model_fields and isinstance(k, str):
                    warn_unknown_field(cls.__name__, k)
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data


class SamplingFields(_Strict):
    """SamplingParams' fields but `logprobs` (whose type differs per API). Unset fields keep
    SamplingParams' defaults; their ranges are SamplingParams' to check."""
    max_tokens: Int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: Int | None = None
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    seed: Int | None = None
    stop: str | StopStrs | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    min_tokens: Int | None = None
    skip_special_tokens: bool | None = None
    # vLLM's extensions
    logit_bias: Annotated[dict[str, Finite], _at_most(MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: Annotated[Strs, _at_most(MAX_BAD_WORDS)] | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: Int | None = None
    cache_salt: str | None = None

    def sampling_kwargs(self) -> dict:
        """The fields a request set, but max_tokens (the server computes the limit). logit_bias
        values are clamped to [-100, 100], as OpenAI and vLLM do."""
        kwargs = {k: v for k in SamplingFields.model_fields
                  if k != "max_tokens" and (v := getattr(self, k)) is not None}
        if self.logit_bias:
            kwargs["logit_bias"] = {k: min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()}
        return kwargs


class NativeSampling(SamplingFields):
    """/generate's `sampling_params`: every SamplingParams field."""
    logprobs: Int | None = None
    prompt_logprobs: Int | None = None       # with max_tokens 0: score the prompt only
    structured_outputs: dict[str, Any] | None = None     # the offline keys: json, regex, choice, grammar, ...

    def grammar_spec(self) -> tuple[StructuredOutputs | None, str]:
        """The request's grammar (or None) and the field that gave it; a 400 naming it if malformed."""
        if not self.structured_outputs:
            return None, "sampling_params.structured_outputs"
        try:
            return StructuredOutputs.from_dict(self.structured_outputs), "sampling_params.structured_outputs"
        except ValueError as exc:
            raise bad_request(str(exc), "sampling_params.structured_outputs") from None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False          # vLLM: every chunk carries the usage so far


class _OpenAIFields(_Lenient, SamplingFields):
    model: str | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                         # accepted and ignored, as an end-user tag
    # vLLM's extensions
    prompt_logprobs: Int | None = None
    return_tokens_as_token_ids: bool | None = None
    add_special_tokens: bool | None = None
    priority: Int | None = None                     # accepted and ignored: requests are served first come first
    request_id: str | None = None                   # accepted and ignored: responses carry the server's ids
    # vLLM fields this server knows but cannot honour: a value that would change results is a 400
    use_beam_search: bool = False
    length_penalty: Finite = 1.0
    logits_processors: Anys | None = None
    spaces_between_special_tokens: bool = True

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be an integer in [1, {MAX_N}], got {self.n!r}.", "n")
        refused = [name for name, off in (("use_beam_search", False), ("length_penalty", 1.0),
                                          ("logits_processors", None), ("spaces_between_special_tokens", True))
                   if getattr(self, name) not in (off, None) and getattr(self, name) != []]
        if refused:
            raise bad_request(f"{refused[0]} is not supported by this server; remove it (or leave it at its "
                              f"default).", refused[0], "unsupported")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                              f"{self.prompt_logprobs}.", "prompt_logprobs")


class StructuredFields(_Strict):
    """vLLM's constrained-decoding fields (`structured_outputs` and the older `guided_*` names)."""
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Strs | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None      # accepted: this server has one backend (xgrammar)

    def structured_spec(self, response_format: dict | None = None) -> tuple[StructuredOutputs | None, str]:
        """The request's one grammar and the field that gave it; a 400 naming the field otherwise."""
        given: list[tuple[str, dict]] = []
        if self.structured_outputs:
            given.append(("structured_outputs", self.structured_outputs))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                given.append((name, {name: getattr(self, name)}))
        if response_format is not None:
            spec = response_format_spec(response_format, "response_format")
            if spec is not None:
                given.append(("response_format", spec))
        if len(given) > 1:
            raise bad_request(f"Give one way to constrain the output, not {given[0][0]} and {given[1][0]}.",
                              given[1][0])
        if not given:
            return None, "tool_choice"
        name, spec = given[0]
        try:
            return StructuredOutputs.from_dict(spec), name
        except ValueError as exc:
            raise bad_request(str(exc), name) from None


def response_format_spec(fmt: dict, param: str) -> dict | None:
    """OpenAI `response_format` (or the Responses API's `text.format`) as structured_outputs keys."""
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                          f"{param}.type")
    holder = fmt.get("json_schema", fmt)          # chat nests it; the Responses API does not
    if not isinstance(holder, dict):
        raise bad_request(f"{param}.json_schema must be an object with 'name' and 'schema'.", f"{param}.json_schema")
    schema = holder.get("schema")
    if schema is None:
        return {"json_object": True}
    if not isinstance(schema, (dict, str)):           # a string is the schema's JSON text (vLLM takes it)
        raise bad_request(f"{param} schema must be a JSON schema object (or its JSON text).",
                          f"{param}.json_schema.schema")
    return {"json": schema}


class CompletionRequest(_OpenAIFields, StructuredFields):
    prompt: str | Strs | TokenIds | Annotated[list[TokenIds], _FAST]
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None

    def check_unsupported(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n); remove it.", "best_of", "unsupported")
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported by this server; remove it.", "suffix", "unsupported")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Anys | None = None
    name: str | None = None
    tool_calls: Anys | None = None            # assistant: the calls it made
    tool_call_id: str | None = None           # tool: the call this answers
    refusal: str | None = None                # assistant messages echoed back by SDKs

    def text(self, i: int, images: Any = None) -> str:
        """The content as text; image parts go to `images` (multimodal.intake.ImageParts, a vision-language
        model's: each stands in the text as its image token), else they are refused."""
        if not isinstance(self.content, list):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and images is not None:
                url = part.get("image_url")
                images.append((url.get("url") if isinstance(url, dict) else url, f"messages[{i}].content[{j}]"))
                texts.append(images.token)
                continue
            if kind == "text" and not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}] is a text part without a 'text' string; write it as "
                                  f"{{\"type\": \"text\", \"text\": \"...\"}}.", f"messages.{i}.content.{j}.text")
            if kind != "text":
                shown = repr(kind[:40]) if isinstance(kind, str) else "non-text"
                also = "" if kind != "image_url" else " (this model takes no images)"
                raise bad_request(f"messages[{i}].content[{j}] is a {shown} part; this server accepts only text "
                                  f"parts{also}.", f"messages.{i}.content", "unsupported")
            texts.append(part["text"])
        return "".join(texts)

    def as_template_dict(self, i: int, images: Any = None) -> dict:
        # NOTE: few chat templates know the "developer" role; it means system.
        role = "system" if self.role == "developer" else self.role
        msg: dict[str, Any] = {"role": role, "content": self.text(i, images)}
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request(f"messages[{i}] has tool_calls but only assistant messages make calls.",
                                  f"messages.{i}.tool_calls")
            msg["tool_calls"] = [_template_call(c, i, j) for j, c in enumerate(self.tool_calls)]
        if self.role == "tool":
            msg["tool_call_id"] = self.tool_call_id
            if self.name:
                msg["name"] = self.name
        return msg


def _template_call(call, i: int, j: int) -> dict:
    """A history tool call as chat templates read it (arguments as an object when they are JSON)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls[{j}] needs a 'function' with a 'name'.",
                          f"messages.{i}.tool_calls.{j}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


CHAT_TEMPLATE_ARGS = frozenset((   # apply_chat_template's own parameters: not template variables
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "template_kwargs"))


class ChatTemplateFields(_Lenient):
    """vLLM's chat-template controls (chat completions and /tokenize with messages)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Annotated[dict[str, Any], _at_most(MAX_MAP_ITEMS)] | None = None

    def template_options(self, trust_request_template: bool) -> dict:
        """Keyword arguments for `Tokenizer.chat_prompt` (none when every control has its default)."""
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true; set "
                              "add_generation_prompt to false to continue the final message.", "continue_final_message")
        if self.chat_template is not None and not trust_request_template:
            raise bad_request("chat_template in a request needs a server started with --trust-request-chat-template; "
                              "remove it to use the model's template.", "chat_template", "unsupported")
        reserved = sorted(CHAT_TEMPLATE_ARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r} (a request field of its own or the "
                              f"server's); remove it.", "chat_template_kwargs")
        options: dict[str, Any] = {}
        if not self.add_generation_prompt:
            options["add_generation_prompt"] = False
        if self.continue_final_message:
            options["continue_final_message"] = True
        if self.chat_template is not None:
            options["chat_template"] = self.chat_template
        if self.chat_template_kwargs:
            options["template_kwargs"] = dict(self.chat_template_kwargs)
        return options


class ChatCompletionRequest(ChatTemplateFields, _OpenAIFields, StructuredFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: Anys | None = None
    tool_choice: Any = None
    functions: Anys | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # accepted and ignored: they tag or route requests, they do not change outputs
    store: bool | None = None
    metadata: Annotated[dict[str, str], _at_most(MAX_MAP_ITEMS)] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None             # gpt-oss's template reads it; ignored by the others
    # output modalities: text only (the SDK sends `audio: null`)
    audio: Any = None
    modalities: Strs | None = None
    echo: bool = False                              # vLLM: the reply starts with the final message's content

    def check_unsupported(self) -> None:
        self.check_common()
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            raise bad_request("This server produces text only; remove audio (or leave it null) and keep modalities "
                              "[\"text\"].", "audio" if self.audio is not None else "modalities", "unsupported")
        if self.functions:
            raise bad_request("functions (the deprecated form of tools) is not supported; send tools instead.",
                              "functions", "unsupported")
        if self.function_call not in (None, "none"):
            raise bad_request("function_call is not supported; send tool_choice instead.", "function_call",
                              "unsupported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.",
                              "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise bad_request("Give max_tokens or max_completion_tokens, not both with different values.",
                              "max_completion_tokens")

    @field_validator("messages", mode="wrap")
    @classmethod
    def _messages_one_by_one(cls, value, handler: ValidatorFunctionWrapHandler):
        return validate_each(value, handler, ChatMessage)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateRequest(_Strict):
    """Native API: one prompt as text, token ids or embeddings [T][H]; SamplingParams fields verbatim."""
    text: str | None = None
    input_ids: TokenIds | None = None
    input_embeds: FloatRows | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    model: str | None = None

    def check(self) -> None:
        given = [k for k in ("text", "input_ids", "input_embeds") if getattr(self, k) is not None]
        if len(given) != 1:
            raise bad_request("Give exactly one of text, input_ids or input_embeds.", given[1] if given else "text")


def make_sampling_params(fields: dict, max_tokens: int, logprobs: int | None, choice: int = 0,
                         param_prefix: str = "", **extra) -> SamplingParams:
    """SamplingParams from validated fields; its own checks (ranges) become 400s naming the field."""
    kwargs = dict(fields, max_tokens=max_tokens, logprobs=logprobs, **extra)
    if kwargs.get("seed") is not None:
        kwargs["seed"] = choice_seed(kwargs["seed"], choice)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_value_error(exc, param_prefix) from None


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of an n > 1 request: choice 0 keeps the request's seed, choice j
    gets a 63-bit hash of (seed, j), so no choice of one seed replays a choice of another (with
    seed + j, seed 124's first choice was seed 123's second) and each stays reproducible."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
