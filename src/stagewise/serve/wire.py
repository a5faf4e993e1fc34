"""Everything that crosses between an engine client and its engine core, as dataclasses, and how
they travel (pickled, one message per `send_bytes`, over a `multiprocessing` pipe).

Client → core: `AddRequests`, `AbortRequests`, `StopEngine`. Core → client: `EngineReady` or
`EngineFailed` once at start-up, then `EngineOutputs` per published step, and `EngineDied` at
most once. Outputs travel as `OutputDelta`s (what changed since the last one), so a step's
message is O(new tokens), not O(whole output); `serve/deltas.py` makes and applies them.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Union

from ..grammar.limits import GrammarLimits
from ..request import SamplingParams, TokenLogprob


@dataclass
class NewRequest:
    """One request, checked by the client; exactly one of ids or embeddings."""
    request_id: str
    prompt_token_ids: list[int] | None
    input_embeds: Any                        # torch.Tensor [T, H] or None
    params: SamplingParams


@dataclass
class AddRequests:
    requests: list[NewRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class StopEngine:
    """Abort everything open, let it leave the pipeline (bounded), shut down, exit."""


@dataclass(slots=True)
class OutputDelta:
    """What one request's output gained since its previous delta. The shown text usually only
    grows, but a stop string can cut text held back earlier, hence (chars kept, new tail)."""
    request_id: str
    text_kept: int
    text_tail: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None        # None: the request asked for no logprobs
    new_prompt_logprobs: list[TokenLogprob | None] | None
    finish_reason: str | None
    error: str | None
    finished: bool
    num_cached_tokens: int
    first_token_time: float | None
    scheduled_time: float | None = None            # first admitted into a plan (the queue time ends)
    error_status: int | None = None                # CompletionOutput.error_status


@dataclass
class EngineFacts:
    """What the client reads about the engine once, at start-up (plain values)."""
    max_model_len: int
    kv_capacity_tokens: int                  # what one request could ever hold (block 0 is reserved)
    model_dir: str
    config_model: str | None                 # the model as configured (a path or a name), an alias
    vocab_size: int
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)   # checked before a request is sent


@dataclass
class EngineReady:
    facts: EngineFacts
    snapshot: dict                           # Engine.stats()


@dataclass
class EngineFailed:
    """The engine could not start; the client raises `error`."""
    error: BaseException


@dataclass
class EngineOutputs:
    time: float                              # time.monotonic() when the core published it
    deltas: list[OutputDelta] = field(default_factory=list)
    snapshot: dict | None = None             # Engine.stats(); None if it failed this time


@dataclass
class EngineDied:
    """The engine cannot go on: `why` for every open request; `deltas` are its last outputs."""
    why: str
    deltas: list[OutputDelta] = field(default_factory=list)


ClientMessage = Union[AddRequests, AbortRequests, StopEngine]
CoreMessage = Union[EngineReady, EngineFailed, EngineOutputs, EngineDied]


def encode(msg: ClientMessage | CoreMessage) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, msg: ClientMessage | CoreMessage) -> None:
    """Raises OSError when the other end is gone."""
    conn.send_bytes(encode(msg))


def recv(conn: Connection) -> ClientMessage | CoreMessage:
    """Raises EOFError or OSError when the other end is gone."""
    return pickle.loads(conn.recv_bytes())
