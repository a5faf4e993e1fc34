"""Command-line flags generated from dataclasses (EngineConfig, SamplingParams, ServerOptions):
one flag per field, named after it (or its `flag` metadata), typed by its annotation, with the
help text the field carries and its default shown in `--help`. Numbers are converted by
argparse; sizes and lists reach the dataclass as text, which refuses a bad one with one sentence.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable


class HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already says what the default is (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: {_shown(action.default)})"


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def add_dataclass_args(group, cls: type, defaults: dict[str, Any] | None = None) -> None:
    """Add a flag for every field of `cls` (but those with metadata cli=False); `defaults`
    overrides the dataclass's defaults for this command."""
    hints = typing.get_type_hints(cls)
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        flags = [meta.get("flag", "--" + f.name.replace("_", "-")), *meta.get("aliases", ())]
        common = {"dest": _dest(f), "default": defaults.get(f.name, f.default), "help": meta.get("help")}
        kind = _base(hints[f.name])
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        elif kind is list and _item(hints[f.name]) is str:
            group.add_argument(*flags, action="append", metavar="TEXT", **common)
        elif meta.get("nargs"):     # several values after one flag (--lora-modules a=x b=y)
            group.add_argument(*flags, nargs=meta["nargs"], action="extend", metavar=_metavar(f), **common)
        else:
            group.add_argument(*flags, type=str if meta.get("size") else _converter(kind), metavar=_metavar(f),
                               **common)


def values_of(cls: type, args: argparse.Namespace, **extra) -> dict[str, Any]:
    """The keyword arguments of `cls` that its flags parsed, plus `extra`."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True):
            value = getattr(args, _dest(f))
            values[f.name] = int_list(value, f.name) if _item(hints[f.name]) is int else value
    return {**values, **extra}


def _dest(f: dataclasses.Field) -> str:
    """Where argparse stores the value: the field's name, unless two dataclasses share it (the
    engine's --seed and the sampling --sample-seed)."""
    return f.metadata.get("dest", f.name)


def _metavar(f: dataclasses.Field) -> str:
    if f.metadata.get("size"):
        return "SIZE"
    return "SECONDS" if f.name.endswith("_s") else f.name.upper()


def _base(hint) -> type:
    """The type a flag parses to: `int | None` -> int, `list[str] | str | None` -> list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    origins = [typing.get_origin(a) or a for a in args]
    for kind in (list, tuple, bool, int, float):
        if kind in origins:
            return kind
    return str


def _item(hint) -> type | None:
    for a in (typing.get_args(hint) if _is_union(hint) else [hint]):
        if typing.get_origin(a) is list:
            return typing.get_args(a)[0]
    return None


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _converter(kind: type) -> Callable[[str], Any]:
    """int and float flags convert here; anything else goes to the dataclass as text (sizes such as
    2GiB, lists such as 3,3,2,2), which refuses a bad value with one sentence."""
    return kind if kind in (int, float) else str


def int_list(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of integers, got {text!r}.") from None
