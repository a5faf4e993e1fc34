"""The pieces of serving messages that have no wire form of their own: `Params` (SamplingParams as it
travels: its one dict-or-dataclass field would make its decoding ambiguous), `TensorRecord` (a
tensor as raw bytes, dtype and shape) and `ErrorRecord` (an exception as its class name and
message, rebuilt on the other side from a fixed set of classes: no exception object travels).
"""
from __future__ import annotations

import builtins
from typing import Any

import msgspec

from .. import errors
from ..request import SamplingParams, StructuredOutputs


class WireError(ValueError):
    """A frame that is not a well-formed serving message (bad bytes, unknown type, wrong field)."""


class Params(msgspec.Struct, kw_only=True):
    """SamplingParams' fields as `__post_init__` leaves them (`stop` a list, `structured_outputs` a
    StructuredOutputs); `int | float` where an int given stays an int, as it was sent."""
    max_tokens: int
    temperature: int | float
    top_p: int | float
    top_k: int
    min_p: int | float
    repetition_penalty: int | float
    presence_penalty: int | float
    frequency_penalty: int | float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    min_tokens: int
    skip_special_tokens: bool
    logit_bias: dict[int, int | float] | None
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    include_stop_str_in_output: bool
    truncate_prompt_tokens: int | None
    cache_salt: str | None
    structured_outputs: StructuredOutputs | None
    embed: bool = False
    lora: str | None = None

    @classmethod
    def of(cls, p: SamplingParams) -> "Params":
        return cls(**{name: getattr(p, name) for name in cls.__struct_fields__})

    def to_sampling_params(self) -> SamplingParams:
        """Checked again on arrival (SamplingParams.__post_init__), as any SamplingParams is."""
        return SamplingParams(**{name: getattr(self, name) for name in self.__struct_fields__})


class TensorRecord(msgspec.Struct, array_like=True):
    dtype: str                     # a torch dtype's name: "float32", "bfloat16"
    shape: list[int]
    data: bytes                    # the elements, C order, native byte order

    @classmethod
    def of(cls, t: Any) -> "TensorRecord | None":
        if t is None:
            return None
        import torch
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), data)

    def to_tensor(self) -> Any:
        import torch
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or any(n < 0 for n in self.shape):
            raise WireError(f"a tensor of dtype {self.dtype!r} and shape {self.shape} cannot be built")
        numel = 1
        for n in self.shape:
            numel *= n
        if numel * dtype.itemsize != len(self.data):
            raise WireError(f"a {self.dtype} tensor of shape {self.shape} with {len(self.data)} bytes of data")
        if not numel:
            return torch.empty(self.shape, dtype=dtype)
        # NOTE: a bytearray copy: torch.frombuffer wants a writable buffer the tensor can keep
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype).reshape(self.shape)


def _rebuildable() -> dict[str, type[BaseException]]:
    """The exception classes a record may name: Python's own and stagewise's (errors.py)."""
    known = {name: obj for name, obj in vars(builtins).items()
             if isinstance(obj, type) and issubclass(obj, BaseException)}
    known.update({name: obj for name, obj in vars(errors).items()
                  if isinstance(obj, type) and issubclass(obj, BaseException)})
    return known


_REBUILDABLE = _rebuildable()


class ErrorRecord(msgspec.Struct):
    """An exception that crossed the boundary: `kind` its class's name, `base` the nearest class in
    its MRO the other side rebuilds (`kind` itself for Python's and stagewise's errors)."""
    kind: str
    base: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "ErrorRecord":
        base = next(c for c in type(exc).__mro__ if _REBUILDABLE.get(c.__name__) is c)
        return cls(type(exc).__name__, base.__name__, str(exc))

    def to_exception(self) -> BaseException:
        """The same class with the same message; another class as its base, its name in the message."""
        cls = _REBUILDABLE.get(self.base, RuntimeError)
        message = self.message if self.kind == self.base else f"{self.kind}: {self.message}"
        try:
            return cls(message)
        except Exception:             # noqa: BLE001  (a class whose constructor wants more than a message)
            return RuntimeError(f"{self.kind}: {self.message}")
