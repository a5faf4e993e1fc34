"""Requests as the driver sees them: sampling parameters, request state, and outputs.

Pure Python (tensors only as opaque `input_embeds`). Validation errors are one sentence
naming the field, so the server can turn them into HTTP 400 verbatim.
"""
from __future__ import annotations

import enum
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from .config import flag


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the model's context
    ABORT = "abort"        # cancelled by the client
    ERROR = "error"        # failed (bad input found late, engine fault)


GREEDY_TEMPERATURE = 1e-5      # below this a temperature means greedy (as in vLLM)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_PENALTY_SCALE = 100.0       # repetition_penalty in [1/100, 100]
MAX_LOGIT_BIAS = 1024           # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 256
MAX_CACHE_SALT_CHARS = 1024
MAX_TOKEN_ID_DIGITS = 19        # token ids are below 2**63


@dataclass
class SamplingParams:
    """OpenAI-style sampling controls. temperature 0 (or below 1e-5) means greedy.

    Every value is checked here, once, to a finite and meaningful range, so no request's numbers
    can reach the sampler as something it cannot compute with.
    """

    max_tokens: int = flag(16, "tokens to generate, at most")
    temperature: float = flag(1.0, "0 (or below 1e-5): greedy")
    top_p: float = flag(1.0, "sample from the smallest set of tokens whose probability reaches this")
    top_k: int = flag(-1, "sample from the k most likely tokens; -1 or 0: off")
    min_p: float = flag(0.0, "drop tokens less likely than this times the most likely one")
    repetition_penalty: float = flag(1.0, "> 1 discourages tokens already in the prompt or output")
    presence_penalty: float = flag(0.0, "subtracted from the logit of every token already generated")
    frequency_penalty: float = flag(0.0, "subtracted per occurrence of a token already generated")
    seed: int | None = flag(None, "per-request sampling seed (default: unseeded)", flag="--sample-seed",
                            dest="sample_seed")
    stop: list[str] | str | None = flag(None, "stop before this text (repeat for several)")
    stop_token_ids: list[int] | None = flag(None, "stop after one of these token ids, e.g. 2,13")
    ignore_eos: bool = flag(False, "keep generating past the end-of-sequence token")
    logprobs: int | None = flag(None, "top-n logprobs per generated token", cli=False)
    prompt_logprobs: int | None = flag(None, "logprob (+ top-n) of every prompt token after the first", cli=False)
    min_tokens: int = flag(0, "tokens to generate before EOS or a stop may end the output")
    skip_special_tokens: bool = flag(True, "leave special tokens out of the text")
    # vLLM's extensions (logits processors on the last stage, output and prompt handling, cache isolation)
    logit_bias: dict[int, float] | None = flag(None, "token id -> bias added to its logit, in [-100, 100]",
                                               cli=False)
    allowed_token_ids: list[int] | None = flag(None, "sample only among these token ids", cli=False)
    bad_words: list[str] | None = flag(None, "words never generated (their last token is banned after the rest)",
                                       cli=False)
    include_stop_str_in_output: bool = flag(False, "keep the matched stop string in the text", cli=False)
    truncate_prompt_tokens: int | None = flag(None, "keep only the last k prompt tokens", cli=False)
    cache_salt: str | None = flag(None, "prefix-cache namespace: requests with different salts share no KV blocks",
                                  cli=False)
    # constrained decoding: a StructuredOutputs or a dict of its fields ({"json": schema}, {"regex": ...})
    structured_outputs: StructuredOutputs | dict | None = flag(None, "constrain the output", cli=False)
    # an embedding request (LLM.embed, /v1/embeddings): the prompt's pooled, normalised last hidden state comes
    # back instead of tokens; max_tokens does not apply (nothing is generated)
    embed: bool = flag(False, "return the prompt's embedding; nothing is generated", cli=False)
    # the LoRA adapter (an --lora-modules name) the request runs with; None: the base model
    lora: str | None = flag(None, "the LoRA adapter (a --lora-modules name) this request runs with", cli=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        self.stop = self.stop if self.stop is not None else []
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
        self.stop_token_ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (str, tuple)):
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_as_token_id(k): v for k, v in self.logit_bias.items()}
        self.validate()
        # NOTE: not a field (no request sets it): the engine derives it from `bad_words` with its tokenizer;
        # token sequences whose last token is banned after the rest
        self.bad_words_token_ids: list[list[int]] | None = None
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0

    def validate(self) -> None:
        for name, check, rule in _RULES:
            value = getattr(self, name)
            if not check(value):
                raise ValueError(f"{name} must be {rule}, got {_shown(value)}.")
        if self.max_tokens == 0 and self.prompt_logprobs is None and not self.embed:
            raise ValueError("max_tokens must be an integer >= 1 (0 only with prompt_logprobs), got 0.")
        if self.embed and (self.prompt_logprobs is not None or self.structured_outputs is not None):
            raise ValueError("prompt_logprobs and structured_outputs must be null for an embedding request (it "
                             "computes no logits).")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}.")
        choices = self.structured_outputs.choice if isinstance(self.structured_outputs, StructuredOutputs) else None
        if choices and not self.ignore_eos and self.min_tokens > max(len(c.encode("utf-8", "replace"))
                                                                     for c in choices):
            raise ValueError(f"min_tokens must be at most the longest choice's length in bytes (a choice ends the "
                             f"output, and no token is shorter than a byte), got {self.min_tokens}.")

    @property
    def grammar(self) -> "StructuredOutputs | None":
        """`structured_outputs` as the StructuredOutputs `__post_init__` made of it."""
        so = self.structured_outputs
        return so if isinstance(so, StructuredOutputs) else None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_logits_processors(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler changes this row's logits first."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop_strings), default=0)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as the list `__post_init__` made of it."""
        return self.stop if isinstance(self.stop, list) else []


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite real number (NaN and infinities are refused)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _in(lo: float, hi: float, lo_open: bool = False):
    return lambda v: _is_num(v) and (lo < v if lo_open else lo <= v) and v <= hi


def _as_token_id(key: Any) -> Any:
    """logit_bias keys as JSON writes them ("42") or as ints; anything else (other digits such as
    "²", more digits than any token id has) is left for the check, which names the field."""
    digits = key.strip().removeprefix("-") if isinstance(key, str) else ""
    if digits.isascii() and digits.isdigit() and len(digits) <= MAX_TOKEN_ID_DIGITS:
        return int(key)
    return key


def _token_ids_ok(v: Any, max_len: int, non_empty: bool = False) -> bool:
    return (isinstance(v, list) and len(v) <= max_len and (bool(v) or not non_empty)
            and all(_is_int(t) and 0 <= t < 2**63 for t in v))


def _bias_ok(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and len(v) <= MAX_LOGIT_BIAS
                         and all(_is_int(k) and 0 <= k < 2**63 and _in(-100.0, 100.0)(b) for k, b in v.items()))


def _stops_ok(v: Any) -> bool:
    return (isinstance(v, list) and len(v) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in v))


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"a {type(v).__name__} of {len(v) if hasattr(v, '__len__') else '?'} items"


# (field, check, the rule as the error message states it)
_RULES = (
    ("max_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 1 (0 only with prompt_logprobs)"),
    ("temperature", lambda v: _is_num(v) and 0 <= v <= 1e6, "a finite number in [0, 1e6] (0 = greedy)"),
    ("top_p", _in(0.0, 1.0, lo_open=True), "a number in (0, 1]"),
    ("top_k", lambda v: _is_int(v) and v >= -1, "-1 (off) or an integer >= 0"),
    ("min_p", _in(0.0, 1.0), "a number in [0, 1]"),
    ("repetition_penalty", _in(1 / MAX_PENALTY_SCALE, MAX_PENALTY_SCALE), "a number in [0.01, 100] (1 = off)"),
    ("presence_penalty", _in(-2.0, 2.0), "a number in [-2, 2]"),
    ("frequency_penalty", _in(-2.0, 2.0), "a number in [-2, 2]"),
    ("seed", lambda v: v is None or _is_int(v), "an integer or null"),
    ("stop", _stops_ok, f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                        f"{MAX_STOP_STRING_CHARS} characters"),
    ("stop_token_ids", lambda v: isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS
                                 and all(_is_int(t) and 0 <= t < 2**63 for t in v),
     f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers"),
    ("ignore_eos", lambda v: isinstance(v, bool), "true or false"),
    ("logprobs", lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), f"an integer in [0, {MAX_LOGPROBS}]"),
    ("prompt_logprobs", lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
     f"an integer in [0, {MAX_LOGPROBS}] or null"),
    ("embed", lambda v: isinstance(v, bool), "true or false"),
    ("lora", lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT_CHARS),
     "null or an adapter name"),
    ("min_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    ("skip_special_tokens", lambda v: isinstance(v, bool), "true or false"),
    ("logit_bias", _bias_ok, f"null or a map of at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]"),
    ("allowed_token_ids", lambda v: v is None or _token_ids_ok(v, MAX_ALLOWED_TOKEN_IDS, non_empty=True),
     "null or a non-empty list of non-negative token ids"),
    ("bad_words", lambda v: v is None or (isinstance(v, list) and len(v) <= MAX_BAD_WORDS
                                          and all(isinstance(w, str) and 0 < len(w.strip()) <= MAX_STOP_STRING_CHARS
                                                  for w in v)),
     f"null or a list of at most {MAX_BAD_WORDS} non-blank strings of at most {MAX_STOP_STRING_CHARS} characters"),
    ("include_stop_str_in_output", lambda v: isinstance(v, bool), "true or false"),
    ("truncate_prompt_tokens", lambda v: v is None or (_is_int(v) and (v >= 1 or v == -1)),
     "null, -1 (the model's context) or an integer >= 1"),
    ("cache_salt", lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT_CHARS),
     f"null or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"),
    ("structured_outputs", lambda v: v is None or isinstance(v, StructuredOutputs),
     "a StructuredOutputs or a dict with one of json, regex, choice, grammar, json_object"),
)


GRAMMAR_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_OLD_NAMES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "grammar", "guided_json_object": "json_object"}


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match: exactly one of a JSON schema (`json`, a dict or its JSON text),
    any JSON object (`json_object`), a regular expression, one of a list of strings (`choice`) or an
    EBNF grammar (GBNF / xgrammar syntax). Size and syntax are checked where the grammar is compiled
    (grammar/), so a bad one fails its request alone with one sentence, before any output."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(GRAMMAR_KINDS)}, got "
                             f"{', '.join(given) or 'none'}.")
        kind = given[0]
        if kind == "json" and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text).")
        if kind in ("regex", "grammar") and not (isinstance(getattr(self, kind), str) and getattr(self, kind)):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string.")
        if kind == "choice" and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputs":
        """vLLM's keys (`json`, `regex`, `choice`, `grammar`, `json_object`) or the older `guided_*` names;
        null values are ignored."""
        kwargs = {}
        for key, value in d.items():
            name = _OLD_NAMES.get(key, key)
            if name not in GRAMMAR_KINDS:
                raise ValueError(f"structured_outputs has an unknown key {key!r}; use one of "
                                 f"{', '.join(GRAMMAR_KINDS)}.")
            if value is not None:
                kwargs[name] = value
        return cls(**kwargs)

    @property
    def kind(self) -> str:
        return next(k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False))

    @functools.cached_property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a compiled grammar is cached by; computed once (the choices of a
        request share one StructuredOutputs, and it travels to the engine with the key made)."""
        import json as _json
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = _json.dumps(value)       # NOTE: key order is the output's property order
        elif kind == "choice":
            value = _json.dumps(list(value))
        elif kind == "json_object":
            value = ""
        return kind, value


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)   # top-n alternatives
    rank: int | None = None                               # the token's rank in the vocabulary (prompt logprobs)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_status: int | None = None        # 4xx: the request itself was at fault (its grammar, ...); 503: retry;
                                           # None: the server



@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None     # with SamplingParams.embed: the pooled, normalised hidden state


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Driver-side state of one request. `num_computed_tokens` counts tokens whose KV is written
    (or scheduled to be: it advances at schedule time, see the pipeline notes)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    input_embeds: Any = None                 # torch.Tensor [T, H] or None
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    embedding: list[float] | None = None     # SamplingParams.embed: set by the last stage's result
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0               # prompt tokens served by the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # chained digests of its full blocks (prefix cache)
    num_registered_blocks: int = 0          # leading blocks already offered to the prefix cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_status: int | None = None          # see CompletionOutput.error_status
    text: str = ""                           # output text shown to the user (stop strings trimmed, held back)
    decoded: str = ""                        # all output text decoded so far
    decode_offsets: tuple[int, int] = (0, 0)   # output-token window of the incremental decoder
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None      # first admitted into a plan (queue time ends)
    first_token_time: float | None = None
    num_preemptions: int = 0
    tenant: int | None = None                # the API key's place (server): the scheduler alternates tenants
    # the LoRA adapter's identity (its name and files' fingerprint), which roots its prefix-cache chain: an
    # adapter loaded again under the same name never meets the KV of the one before; None: the name does
    lora_key: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length; an `input_embeds` prompt has no ids, one row per position."""
        return len(self.prompt_token_ids) if self.input_embeds is None else int(self.input_embeds.shape[0])

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
