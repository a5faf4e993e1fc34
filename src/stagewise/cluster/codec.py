"""Dataclasses to plain values and back with msgspec, tensors set aside to travel raw (transport.py)
as their index in a list. Only the dataclasses a Codec is given can cross; decoding checks every
value against its field's type (msgspec) and raises WireError naming the field. No pickle: nothing on
the wire can name a Python object, only the codec's own types.

A message is [type name, its fields as an object]. A field typed `Any` must be given its wire type
in `overrides`; a class whose wire types differ from its annotations (overrides, tensors) or that
carries `extras` (attributes that are not fields) travels as a msgspec Struct made from it, its
*wire struct*, and is rebuilt through its constructor; any other dataclass msgspec carries as itself.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any, Callable

import msgspec
import torch

NoneType = type(None)
_WHERE = re.compile(r"(.*?)(?: - at (`key` in )?`\$\.?(.*)`)?", re.S)     # msgspec's "why - at `$.path`"
JsonValue = Any        # a field that holds plain JSON (a schema): it passes as it is


class WireError(ValueError):
    """A message that does not match its schema: unknown type, wrong field type, bad tensor."""

    def __init__(self, why: str, path: tuple[str, ...] = ()):
        super().__init__(why)
        self.why, self.path = why, path

    def at(self, name: str) -> "WireError":
        return WireError(self.why, (name, *self.path))

    def __str__(self) -> str:
        return f"{'.'.join(self.path).replace('.[', '[')}: {self.why}" if self.path else self.why


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor field: the dtypes and number of dimensions it may have (None: any)."""
    dtypes: tuple[torch.dtype, ...] | None = None
    ndim: int | None = None


@dataclasses.dataclass(frozen=True)
class OrNone:
    """`spec | None` for a TensorSpec (which is not a type, so `|` cannot say it)."""
    spec: TensorSpec


class _TensorType(type):
    """A tensor field's wire type: msgspec hands its value (an index) to the decode hook, and checks
    that what the hook returns is an instance of it, which any tensor is."""
    spec: TensorSpec

    def __instancecheck__(cls, value: Any) -> bool:
        return isinstance(value, torch.Tensor)


@functools.cache
def _tensor_type(spec: TensorSpec) -> type:
    return _TensorType("Tensor", (), {"spec": spec})


class Codec:
    def __init__(self, types_: list[type], overrides: dict[tuple[type, str], Any] | None = None,
                 extras: dict[type, dict[str, Any]] | None = None):
        """`types_`: every dataclass that may cross; `overrides`: (class, field) -> the wire type of a
        field annotated `Any`; `extras`: class -> {attribute: type} of non-field attributes that cross too."""
        self.types = {t.__name__: t for t in types_}
        self.overrides, self.extras = overrides or {}, extras or {}
        self.structs: dict[type, type | None] = {}          # class -> its wire struct (None: itself)
        self.to_struct: dict[type, Callable[[Any], Any]] = {}
        self.from_struct: dict[type, Callable[[Any], Any]] = {}
        self.wire_types = {t: self._struct(t) or t for t in types_}

    def encode(self, obj: Any) -> tuple[list, list[torch.Tensor]]:
        """([type name, value], tensors set aside)."""
        cls = type(obj)
        if self.types.get(cls.__name__) is not cls:
            raise WireError(f"{cls.__name__} is not a message type")
        tensors: list[torch.Tensor] = []

        def set_aside(v: Any) -> int:
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"a {type(v).__name__} cannot cross processes")
            tensors.append(v)
            return len(tensors) - 1
        try:
            value = msgspec.to_builtins(self.to_struct[cls](obj) if cls in self.to_struct else obj,
                                        enc_hook=set_aside)
        except (TypeError, WireError) as exc:
            raise WireError(f"{cls.__name__} cannot be encoded: {exc}") from None
        return [cls.__name__, value], tensors

    def decode(self, wire: Any, tensors: list[torch.Tensor], allowed: tuple[type, ...]) -> Any:
        """The object `encode` made, which must be one of `allowed`; WireError if it does not fit."""
        if not (isinstance(wire, list) and len(wire) == 2 and isinstance(wire[0], str)):
            raise WireError("a message is [type name, value]")
        cls = self.types.get(wire[0])
        if cls is None or cls not in allowed:
            raise WireError(f"unknown message type {wire[0][:64]!r}")
        try:
            # NOTE: str_keys: JSON made the keys of int-keyed dicts (logit_bias, top logprobs) strings
            obj: Any = msgspec.convert(wire[1], self.wire_types[cls], str_keys=True,
                                  dec_hook=functools.partial(_tensor_at, tensors))
            return self.from_struct[cls](obj) if cls in self.from_struct else obj
        except msgspec.ValidationError as exc:       # "Expected `int`, got `str` - at `$.plan.seqs[0]`"
            why, key, where = _WHERE.fullmatch(str(exc)).groups()   # type: ignore[union-attr]
            raise WireError(why + (" (a key)" if key else ""), (cls.__name__, where) if where else (cls.__name__,)) \
                from None
        except WireError as exc:
            raise exc.at(cls.__name__) from None

    # a class's wire struct, when it needs one, and the conversions to and from it
    def _struct(self, cls: type) -> type | None:
        if cls in self.structs:
            return self.structs[cls]
        if self.types.get(cls.__name__) is not cls:
            raise TypeError(f"{cls.__name__} crosses processes but is not one of the codec's types")
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        kinds = {f.name: self._field_type(cls, f.name, hints[f.name]) for f in fields}
        kinds.update(self.extras.get(cls, {}))
        wires = {name: self._wire(kind) for name, kind in kinds.items()}
        if cls not in self.extras and all(wires[f.name] == hints[f.name] for f in fields):
            self.structs[cls] = None
            return None
        struct = msgspec.defstruct(cls.__name__, list(wires.items()), forbid_unknown_fields=True)
        convs = [(name, self._conv(kind)) for name, kind in kinds.items()]
        by_position = cls not in self.extras and all(f.init for f in fields)

        def to_struct(v: Any) -> Any:
            if type(v) is not cls:
                raise WireError(f"expected {cls.__name__}, got {type(v).__name__}")
            return struct(*[c[0](getattr(v, n)) if c else getattr(v, n) for n, c in convs])

        def from_struct(s: Any) -> Any:
            values = {}
            for n, c in convs:
                try:
                    values[n] = c[1](getattr(s, n)) if c else getattr(s, n)
                except WireError as exc:
                    raise exc.at(n) from None
            try:
                return cls(*values.values()) if by_position else _build(cls, fields, values)
            except (TypeError, ValueError) as exc:
                raise WireError(f"{cls.__name__} refused its values: {exc}") from None
        self.structs[cls], self.to_struct[cls], self.from_struct[cls] = struct, to_struct, from_struct
        return struct

    def _field_type(self, cls: type, name: str, hint: Any) -> Any:
        if (cls, name) in self.overrides:
            return self.overrides[(cls, name)]
        if hint is Any:
            raise TypeError(f"{cls.__name__}.{name} is typed Any: give its wire type in the codec's overrides")
        return hint

    def _wire(self, hint: Any) -> Any:
        """The type msgspec decodes `hint` as: wire structs and tensor types in place of classes and specs."""
        if isinstance(hint, TensorSpec):
            return _tensor_type(hint)
        if isinstance(hint, OrNone):
            return typing.Optional[_tensor_type(hint.spec)]
        if dataclasses.is_dataclass(hint):
            return self._struct(hint) or hint      # type: ignore[arg-type]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            return typing.Union[tuple(self._wire(a) for a in args)]
        if origin in (list, tuple, dict):
            return origin[tuple(a if a is Ellipsis else self._wire(a) for a in args)]
        return hint

    def _holds_struct(self, hint: Any) -> bool:
        if isinstance(hint, (TensorSpec, OrNone)):
            return False
        if dataclasses.is_dataclass(hint):
            return self._struct(hint) is not None          # type: ignore[arg-type]
        return any(self._holds_struct(a) for a in typing.get_args(hint) if a is not Ellipsis)

    def _conv(self, hint: Any) -> tuple[Callable, Callable] | None:
        """(to wire struct, from wire struct) of a value typed `hint`; None when it crosses as it is."""
        if not self._holds_struct(hint):
            return None
        if dataclasses.is_dataclass(hint):
            return self.to_struct[hint], self.from_struct[hint]        # type: ignore[index]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType) and len(args) == 2 and NoneType in args:
            to, back = self._conv(next(a for a in args if a is not NoneType))      # type: ignore[misc]
            return (lambda v: None if v is None else to(v)), (lambda v: None if v is None else back(v))
        if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            to, back = self._conv(args[0])                                          # type: ignore[misc]
            return (lambda v: [to(x) for x in v]), (lambda v: origin(_each(back, v)))
        if origin is dict:
            to, back = self._conv(args[1])                                          # type: ignore[misc]
            return (lambda v: {k: to(x) for k, x in v.items()}), (lambda v: {k: back(x) for k, x in v.items()})
        raise TypeError(f"the codec cannot carry {hint!r}: a class with a wire struct inside it")


def _each(back: Callable, values: Any) -> list:
    try:
        return [back(x) for x in values]
    except WireError:            # again, item by item, to say which one
        for i, x in enumerate(values):
            try:
                back(x)
            except WireError as exc:
                raise exc.at(f"[{i}]") from None
        raise


def _build(cls: type, fields: tuple, values: dict[str, Any]) -> Any:
    """An object from its init fields' values, then its other fields and extras set on it."""
    obj = cls(**{f.name: values.pop(f.name) for f in fields if f.init})
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def _tensor_at(tensors: list[torch.Tensor], kind: type, index: Any) -> torch.Tensor:
    """msgspec's decode hook: the tensor a field's index names, checked against the field's spec."""
    spec = kind.spec if isinstance(kind, _TensorType) else TensorSpec() if kind is torch.Tensor else None
    if spec is None:
        raise NotImplementedError(f"the codec cannot decode {kind!r}")
    if type(index) is not int or not 0 <= index < len(tensors):
        raise ValueError("expected the index of a tensor sent with the message")
    t = tensors[index]
    if spec.dtypes is not None and t.dtype not in spec.dtypes:
        raise ValueError(f"a tensor of dtype {t.dtype} where {', '.join(map(str, spec.dtypes))} belongs")
    if spec.ndim is not None and t.dim() != spec.ndim:
        raise ValueError(f"a tensor of {t.dim()} dimensions where {spec.ndim} belong")
    return t
