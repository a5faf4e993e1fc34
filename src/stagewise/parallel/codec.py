"""Dataclasses to JSON-able values and back, by their annotations, with tensors set aside to travel
raw (transport.py). Only the dataclasses a Codec is given can cross; decoding checks every value
against its field's type and raises WireError naming the field. No pickle: nothing on the wire
can name a Python object, only the codec's own types.

Encoding: a dataclass is the list of its field values in declared order (then its `extras`,
attributes that are not fields); `X | None` is null or X; any other union is [member index,
value]; a dict with int keys is a list of [key, value] pairs; a tensor is its index in the list
set aside. A field typed `Any` must be given its wire type in `overrides`.
"""
from __future__ import annotations

import dataclasses
import operator
import types
import typing
from typing import Any, Callable

import torch

Enc = Callable[[Any, list], Any]
Dec = Callable[[Any, list], Any]
NoneType = type(None)


class WireError(ValueError):
    """A message that does not match its schema: unknown type, wrong field type, bad tensor."""

    def __init__(self, why: str, path: tuple[str, ...] = ()):
        super().__init__(why)
        self.why, self.path = why, path

    def at(self, name: str) -> "WireError":
        return WireError(self.why, (name, *self.path))

    def __str__(self) -> str:
        return f"{'.'.join(self.path)}: {self.why}" if self.path else self.why


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor field: the dtypes and number of dimensions it may have (None: any)."""
    dtypes: tuple[torch.dtype, ...] | None = None
    ndim: int | None = None


@dataclasses.dataclass(frozen=True)
class OrNone:
    """`spec | None` for a TensorSpec (which is not a type, so `|` cannot say it)."""
    spec: TensorSpec


class JsonValue:
    """Marks a field that holds plain JSON (a schema): passed through as JSON decodes it."""


class Codec:
    def __init__(self, types_: list[type], overrides: dict[tuple[type, str], Any] | None = None,
                 extras: dict[type, dict[str, Any]] | None = None):
        """`types_`: every dataclass that may cross; `overrides`: (class, field) -> the wire type of a
        field annotated `Any`; `extras`: class -> {attribute: type} of non-field attributes that cross too."""
        self.types = {t.__name__: t for t in types_}
        self.overrides, self.extras = overrides or {}, extras or {}
        self.enc: dict[type, Enc] = {}
        self.dec: dict[type, Dec] = {}
        for t in types_:
            self._dataclass(t)

    def encode(self, obj: Any) -> tuple[list, list[torch.Tensor]]:
        """([type name, value], tensors set aside)."""
        cls = type(obj)
        if cls not in self.enc:
            raise WireError(f"{cls.__name__} is not a message type")
        tensors: list[torch.Tensor] = []
        return [cls.__name__, self.enc[cls](obj, tensors)], tensors

    def decode(self, wire: Any, tensors: list[torch.Tensor], allowed: tuple[type, ...]) -> Any:
        """The object `encode` made, which must be one of `allowed`; WireError if it does not fit."""
        if not (isinstance(wire, list) and len(wire) == 2 and isinstance(wire[0], str)):
            raise WireError("a message is [type name, value]")
        cls = self.types.get(wire[0])
        if cls is None or cls not in allowed:
            raise WireError(f"unknown message type {wire[0][:64]!r}")
        try:
            return self.dec[cls](wire[1], tensors)
        except WireError as exc:
            raise exc.at(cls.__name__) from None
        except RecursionError:
            raise WireError("nested too deeply") from None

    # compiling a type into an encoder and a decoder
    def _dataclass(self, cls: type) -> tuple[Enc, Dec]:
        if cls in self.dec:
            return self.enc[cls], self.dec[cls]
        if not dataclasses.is_dataclass(cls) or cls.__name__ not in self.types:
            raise TypeError(f"{cls.__name__} crosses processes but is not one of the codec's types")
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        extra = self.extras.get(cls, {})
        self.enc[cls] = self.dec[cls] = None  # type: ignore[assignment]   # recursive types resolve later
        kinds = [self._field_type(cls, f.name, hints[f.name]) for f in fields] + list(extra.values())
        attrs = [f.name for f in fields] + list(extra)
        pairs = [self._of(k) for k in kinds]
        encs = [p[0] for p in pairs]
        # NOTE: the hot path (a plan per step per stage): scalars are checked inline, not by a call each
        scalars = [(i, _scalar_types(k)) for i, k in enumerate(kinds) if _scalar_types(k)]
        flat = [(i, _flat_list_types(k)) for i, k in enumerate(kinds) if not _scalar_types(k) and _flat_list_types(k)]
        nested = [(i, pairs[i][1]) for i, k in enumerate(kinds) if not _scalar_types(k) and not _flat_list_types(k)]
        positional = not extra and all(f.init for f in fields)
        get = operator.attrgetter(*attrs) if len(attrs) > 1 else (lambda v: (getattr(v, attrs[0]),)) if attrs \
            else (lambda v: ())

        plain = {i for i, _ in scalars + flat}        # JSON carries these as they are
        nested_encs = [(i, e) for i, e in enumerate(encs) if i not in plain]

        def enc(v, ts):
            if type(v) is not cls:
                raise WireError(f"expected {cls.__name__}, got {type(v).__name__}")
            out = list(get(v))
            for i, e in nested_encs:
                out[i] = e(out[i], ts)
            return out

        def dec(v, ts):
            if type(v) is not list or len(v) != len(attrs):
                raise WireError(f"expected {cls.__name__} as a list of {len(attrs)} values")
            for i, allowed in scalars:
                if type(v[i]) not in allowed:
                    raise WireError(f"expected {_name(kinds[i])}, got {type(v[i]).__name__}").at(attrs[i])
            for i, allowed in flat:
                if type(v[i]) is not list or not set(map(type, v[i])) <= allowed:
                    raise WireError(f"expected {_name(kinds[i])}").at(attrs[i])
            if nested:
                v = list(v)          # NOTE: the caller's value stays as it was
            for i, d in nested:
                try:
                    v[i] = d(v[i], ts)
                except WireError as exc:
                    raise exc.at(attrs[i]) from None
            try:
                return cls(*v) if positional else self._build(cls, fields, attrs, v)
            except (TypeError, ValueError) as exc:
                raise WireError(f"{cls.__name__} refused its values: {exc}") from None
        self.enc[cls], self.dec[cls] = enc, dec
        return enc, dec

    @staticmethod
    def _build(cls: type, fields: tuple, attrs: list[str], values: list) -> Any:
        """An object from its fields' values, then the values of non-init fields and extras set on it."""
        obj = cls(**{f.name: x for f, x in zip(fields, values) if f.init})
        for a, x in list(zip(attrs, values))[len(fields):] + [(f.name, x) for f, x in zip(fields, values)
                                                              if not f.init]:
            object.__setattr__(obj, a, x)
        return obj

    def _field_type(self, cls: type, name: str, hint: Any) -> Any:
        if (cls, name) in self.overrides:
            return self.overrides[(cls, name)]
        if hint is Any:
            raise TypeError(f"{cls.__name__}.{name} is typed Any: give its wire type in the codec's overrides")
        return hint

    def _of(self, hint: Any) -> tuple[Enc, Dec]:
        """Encoder and decoder of one annotation."""
        if hint in (int, float, str, bool, NoneType):
            return _same, _scalar(hint)
        if hint is JsonValue:
            return _same, _same
        if hint is torch.Tensor:
            return self._of(TensorSpec())
        if isinstance(hint, TensorSpec):
            return _tensor_enc, _tensor_dec(hint)
        if isinstance(hint, OrNone):
            return self._union((hint.spec, NoneType))
        if dataclasses.is_dataclass(hint):
            self._dataclass(hint)       # type: ignore[arg-type]
            return (lambda v, ts: self.enc[hint](v, ts)), (lambda v, ts: self.dec[hint](v, ts))   # type: ignore
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            return self._union(args)
        if origin is list:
            return self._list(args[0])
        if origin is tuple:
            return self._tuple(args)
        if origin is dict:
            return self._dict(args[0], args[1])
        raise TypeError(f"the codec cannot carry {hint!r}")

    def _union(self, args: tuple) -> tuple[Enc, Dec]:
        members = [a for a in args if a is not NoneType]
        if len(members) == 1 and len(args) == 2:        # X | None
            e, d = self._of(members[0])
            return (lambda v, ts: None if v is None else e(v, ts)), (lambda v, ts: None if v is None else d(v, ts))
        pairs = [self._of(a) for a in args]
        checks = [_isinstance_check(a) for a in args]

        def enc(v, ts):
            for i, (check, (e, _)) in enumerate(zip(checks, pairs)):
                if check(v):
                    return [i, e(v, ts)]
            raise WireError(f"{type(v).__name__} is none of {args}")

        def dec(v, ts):
            if type(v) is not list or len(v) != 2 or type(v[0]) is not int or not 0 <= v[0] < len(pairs):
                raise WireError("expected a union as [member index, value]")
            return pairs[v[0]][1](v[1], ts)
        return enc, dec

    def _list(self, item: Any) -> tuple[Enc, Dec]:
        if item in (int, float, str, bool):
            allowed = {int, float} if item is float else {item}
            name = item.__name__

            def dec_flat(v, ts):
                if type(v) is not list or not set(map(type, v)) <= allowed:
                    raise WireError(f"expected a list of {name}")
                return v
            return (lambda v, ts: list(v)), dec_flat
        e, d = self._of(item)

        def dec(v, ts):
            if type(v) is not list:
                raise WireError("expected a list")
            try:
                return [d(x, ts) for x in v]
            except WireError:            # again, item by item, to say which one
                return [_at(d, x, ts, i) for i, x in enumerate(v)]
        return (lambda v, ts: [e(x, ts) for x in v]), dec

    def _tuple(self, args: tuple) -> tuple[Enc, Dec]:
        if len(args) == 2 and args[1] is Ellipsis:
            e, d = self._list(args[0])
            return e, (lambda v, ts: tuple(d(v, ts)))
        pairs = [self._of(a) for a in args]

        def dec(v, ts):
            if type(v) is not list or len(v) != len(pairs):
                raise WireError(f"expected a tuple of {len(pairs)} values")
            return tuple(_at(d, x, ts, i) for i, ((_, d), x) in enumerate(zip(pairs, v)))
        return (lambda v, ts: [e(x, ts) for (e, _), x in zip(pairs, v)]), dec

    def _dict(self, key: Any, value: Any) -> tuple[Enc, Dec]:
        if key not in (str, int):
            raise TypeError(f"the codec carries dicts with str or int keys, not {key!r}")
        e, d = self._of(value)
        if key is str and (allowed := set(_scalar_types(value))):     # the hot case: request id -> number
            def dec_flat(v, ts):
                if type(v) is not dict or not set(map(type, v.values())) <= allowed:
                    raise WireError(f"expected an object of {_name(value)}")
                return v
            return (lambda v, ts: {_str_key(k): x for k, x in v.items()}), dec_flat
        if key is str:          # a JSON object
            def dec_obj(v, ts):
                if type(v) is not dict:
                    raise WireError("expected an object")
                return {k: _at(d, x, ts, k) for k, x in v.items()}
            return (lambda v, ts: {_str_key(k): e(x, ts) for k, x in v.items()}), dec_obj

        def dec_pairs(v, ts):   # int keys: [[key, value], ...], so they stay ints
            if type(v) is not list or not all(type(p) is list and len(p) == 2 and type(p[0]) is int for p in v):
                raise WireError("expected a list of [integer key, value] pairs")
            return {k: _at(d, x, ts, str(k)) for k, x in v}
        return (lambda v, ts: [[_int_key(k), e(x, ts)] for k, x in v.items()]), dec_pairs


_ALLOWED = {int: (int,), float: (int, float), str: (str,), bool: (bool,), NoneType: (NoneType,)}


def _scalar_types(hint: Any) -> tuple[type, ...]:
    """The JSON types a scalar or optional-scalar annotation allows (empty: not one)."""
    if hint in _ALLOWED:
        return _ALLOWED[hint]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and all(a in _ALLOWED for a in args):
        return tuple(t for a in args for t in _ALLOWED[a])
    return ()


def _flat_list_types(hint: Any) -> set[type]:
    """The item types a list of scalars allows (empty: not one)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args[0] in (int, float, str, bool):
        return set(_ALLOWED[args[0]])
    return set()


def _name(hint: Any) -> str:
    if hint is NoneType:
        return "null"
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("NoneType", "None")


def _same(v, ts):
    return v


def _scalar(kind: type) -> Dec:
    allowed = (int, float) if kind is float else (kind,)

    def dec(v, ts):
        if type(v) not in allowed:
            raise WireError(f"expected {kind.__name__ if kind is not NoneType else 'null'}, got {type(v).__name__}")
        return v
    return dec


def _at(d: Dec, x, ts, where) -> Any:
    try:
        return d(x, ts)
    except WireError as exc:
        raise exc.at(f"[{where}]") from None


def _str_key(k) -> str:
    if type(k) is not str:
        raise WireError(f"expected a str key, got {type(k).__name__}")
    return k


def _int_key(k) -> int:
    if type(k) is not int:
        raise WireError(f"expected an int key, got {type(k).__name__}")
    return k


def _isinstance_check(hint: Any) -> Callable[[Any], bool]:
    if hint is NoneType:
        return lambda v: v is None
    if hint is float:
        return lambda v: type(v) in (int, float)
    if hint in (int, str, bool):
        return lambda v: type(v) is hint
    if isinstance(hint, TensorSpec):
        return lambda v: isinstance(v, torch.Tensor)
    origin = typing.get_origin(hint) or hint
    return lambda v: isinstance(v, origin)


def _tensor_enc(v, ts: list) -> int:
    if not isinstance(v, torch.Tensor):
        raise WireError(f"expected a tensor, got {type(v).__name__}")
    ts.append(v)
    return len(ts) - 1


def _tensor_dec(spec: TensorSpec) -> Dec:
    def dec(v, ts):
        if type(v) is not int or not 0 <= v < len(ts):
            raise WireError("expected the index of a tensor sent with the message")
        t = ts[v]
        if spec.dtypes is not None and t.dtype not in spec.dtypes:
            raise WireError(f"a tensor of dtype {t.dtype} where {', '.join(map(str, spec.dtypes))} belongs")
        if spec.ndim is not None and t.dim() != spec.ndim:
            raise WireError(f"a tensor of {t.dim()} dimensions where {spec.ndim} belong")
        return t
    return dec
