"""Everything that crosses between an engine client and its engine core, and how it travels:
msgspec Structs, tagged by type, as MessagePack, one message per `send_bytes` over a
`multiprocessing` pipe; each side decodes only the union of the other side's messages, and
nothing on this boundary is pickled (a frame that is not such a message raises WireError).

Client → core: `AddRequests`, `AbortRequests`, `UpdateLora`, `StopEngine`. Core → client:
`EngineReady` or `EngineFailed` once at start-up, then `EngineOutputs` per published step,
`LoraUpdated` per `UpdateLora`, and `EngineDied` at most once. Outputs travel as `OutputDelta`s
(what changed since the last one), so a step's message is O(new tokens), not O(whole output);
`core/deltas.py` makes and applies them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Union

import msgspec

from ..grammar.limits import GrammarLimits
from ..request import TokenLogprob
from .records import ErrorRecord, Params, TensorRecord, WireError

__all__ = ["ErrorRecord", "Params", "TensorRecord", "WireError"]   # re-exported: a message's field types


class NewRequest(msgspec.Struct):
    """One request, checked by the client; exactly one of ids or embeddings."""
    request_id: str
    prompt_token_ids: list[int] | None
    input_embeds: TensorRecord | None        # a torch.Tensor [T, H]: TensorRecord.of / to_tensor
    params: Params                           # Params.of / to_sampling_params
    tenant: int | None = None                # the API key's place: the scheduler alternates tenants


class AddRequests(msgspec.Struct, tag=True):
    requests: list[NewRequest]


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class UpdateLora(msgspec.Struct, tag=True):
    """A runtime LoRA load (`path` set) or unload (`path` None); answered by one `LoraUpdated`.
    `base_names`: the names the server serves the base model under (an adapter may not take one)."""
    call_id: int
    name: str
    path: str | None = None
    base_names: list[str] = []


class StopEngine(msgspec.Struct, tag=True):
    """Abort everything open, let it leave the pipeline (bounded), shut down, exit."""


class OutputDelta(msgspec.Struct, array_like=True):
    """What one request's output gained since its previous delta. The shown text usually only
    grows, but a stop string can cut text held back earlier, hence (chars kept, new tail).
    Fields travel by position (array_like): the hot message, one per request per step."""
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
    embedding: list[float] | None = None           # RequestOutput.embedding (with the finishing delta)


@dataclass
class EngineFacts:
    """What the client reads about the engine once, at start-up (plain values; a dataclass, which
    msgspec encodes by its fields, so that the client's EngineInfo can extend it)."""
    max_model_len: int
    kv_capacity_tokens: int                  # what one request could ever hold (block 0 is reserved)
    model_dir: str
    config_model: str | None                 # the model as configured (a path or a name), an alias
    vocab_size: int
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)   # checked before a request is sent
    lora_names: tuple[str, ...] = ()         # the LoRA adapters (--lora-modules) a request's model may name
    lora_runtime_updates: bool = False       # --enable-lora-runtime-updates: UpdateLora is served


class EngineReady(msgspec.Struct, tag=True):
    facts: EngineFacts
    snapshot: dict                           # Engine.stats(): JSON-like values (tuples arrive as lists)


class EngineFailed(msgspec.Struct, tag=True):
    """The engine could not start; the client raises `error.to_exception()`."""
    error: ErrorRecord


class EngineOutputs(msgspec.Struct, tag=True):
    time: float                              # time.monotonic() when the core published it
    deltas: list[OutputDelta] = []
    snapshot: dict | None = None             # Engine.stats(); None if it failed this time


class LoraUpdated(msgspec.Struct, tag=True):
    """The answer to an `UpdateLora`: the adapters held now, or why it was refused (`kind`: invalid,
    not_found or in_use)."""
    call_id: int
    lora_names: list[str]
    error: str | None = None
    kind: str | None = None


class EngineDied(msgspec.Struct, tag=True):
    """The engine cannot go on: `why` for every open request; `deltas` are its last outputs."""
    why: str
    deltas: list[OutputDelta] = []


ClientMessage = Union[AddRequests, AbortRequests, UpdateLora, StopEngine]
CoreMessage = Union[EngineReady, EngineFailed, EngineOutputs, LoraUpdated, EngineDied]


def _plain(obj: Any) -> Any:
    """numpy and 0-d torch scalars (a stats value computed with them) as the Python number."""
    if hasattr(obj, "item") and getattr(obj, "ndim", 0) == 0:
        return obj.item()
    raise NotImplementedError(f"a {type(obj).__name__} cannot be sent to or from the engine core")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)
_FROM_CLIENT = msgspec.msgpack.Decoder(ClientMessage)
_FROM_CORE = msgspec.msgpack.Decoder(CoreMessage)


def encode(msg: ClientMessage | CoreMessage) -> bytes:
    return _ENCODER.encode(msg)


def decode_client(data: bytes) -> ClientMessage:
    """A client message; raises WireError if `data` is not one."""
    return _decode(_FROM_CLIENT, data, "client")


def decode_core(data: bytes) -> CoreMessage:
    """An engine core message; raises WireError if `data` is not one."""
    return _decode(_FROM_CORE, data, "engine core")


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, sender: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, WireError) as exc:
        raise WireError(f"a malformed message from the {sender} ({len(data)} bytes): {exc}") from None


def send(conn: Connection, msg: ClientMessage | CoreMessage) -> None:
    """Raises OSError when the other end is gone."""
    conn.send_bytes(encode(msg))


def recv_client(conn: Connection) -> ClientMessage:
    """Raises EOFError or OSError when the other end is gone, WireError on a malformed frame."""
    return decode_client(conn.recv_bytes())


def recv_core(conn: Connection) -> CoreMessage:
    """Raises EOFError or OSError when the other end is gone, WireError on a malformed frame."""
    return decode_core(conn.recv_bytes())
