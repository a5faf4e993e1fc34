"""Requests as the driver sees them: sampling parameters, request state, and outputs.

Pure Python (tensors only as opaque `input_embeds`). Validation errors are one sentence
naming the field, so the server can turn them into HTTP 400 verbatim.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the model's context
    ABORT = "abort"        # cancelled by the client
    ERROR = "error"        # failed (bad input found late, engine fault)


@dataclass
class SamplingParams:
    """OpenAI-style sampling controls. temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None          # top-n logprobs per generated token
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        need(_is_num(self.temperature) and self.temperature >= 0, f"temperature must be a number >= 0, got {self.temperature!r}.")
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}.")
        need(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), f"top_k must be -1 (off) or an integer >= 0, got {self.top_k!r}.")
        need(_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}.")
        need(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_is_num(v) and -2 <= v <= 2, f"{name} must be a number in [-2, 2], got {v!r}.")
        need(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}.")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be a non-empty string or a list of non-empty strings.")
        need(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be a list of non-negative integers.")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}.")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens, f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)   # top-n alternatives


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


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
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0               # prompt tokens served by the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of its full blocks (prefix cache)
    num_registered_blocks: int = 0          # leading blocks already offered to the prefix cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""                           # detokenized output (after stop-string trimming)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0

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
