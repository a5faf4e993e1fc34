"""What a constraint may be and what compiling it may cost (`GrammarLimits`, from the engine config),
and the check of a constraint's text against them: size, nesting depth and number of alternatives.

The check is linear in the text and needs no grammar backend, so the server runs it once per request
on an intake thread (a 400 naming the limit and its flag) and the compile supervisor runs it again
before compiling. What no cheap check can bound (a regex that compiles for minutes, or to gigabytes)
the compile budgets bound (grammar/compiler.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from ..config import RequestLimits
from .refusals import GrammarRefused, check_repetitions
from .schema import depth_message, json_shape

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_DEFAULT: dict[str, Any] = {f.name: f.default for f in fields(RequestLimits)}


@dataclass(frozen=True)
class GrammarLimits:
    """The grammar part of `RequestLimits` under short names; its defaults are RequestLimits' own."""
    max_bytes: int = _DEFAULT["grammar_max_bytes"]
    max_depth: int = _DEFAULT["grammar_max_depth"]
    max_alternatives: int = _DEFAULT["grammar_max_alternatives"]
    compile_timeout_s: float = _DEFAULT["grammar_compile_timeout_s"]
    memory: int = _DEFAULT["grammar_memory"]                 # all compile workers together
    workers: int = _DEFAULT["grammar_compile_workers"]
    cache_entries: int = _DEFAULT["grammar_cache_entries"]
    cache_memory: int = _DEFAULT["grammar_cache_memory"]     # kept compiled grammars together; also the largest one

    @classmethod
    def of(cls, lim) -> "GrammarLimits":
        """From the engine's request limits (`EngineConfig.limits`)."""
        return cls(lim.grammar_max_bytes, lim.grammar_max_depth, lim.grammar_max_alternatives,
                   lim.grammar_compile_timeout_s, lim.grammar_memory, lim.grammar_compile_workers,
                   lim.grammar_cache_entries, lim.grammar_cache_memory)

    @property
    def quick_memory(self) -> int:
        """The quick lane's memory (grammar/compiler.py): an eighth of --grammar-memory."""
        return self.memory // 8

    @property
    def memory_per_compile(self) -> int:
        """A worker's memory: the workers share what the quick lane leaves."""
        return (self.memory - self.quick_memory) // self.workers


def check_limits(kind: str, text: str, limits: GrammarLimits) -> None:
    """Raise GrammarRefused when the constraint `text` of `kind` (StructuredOutputs.key) is larger,
    deeper or has more alternatives than `limits` allow."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarRefused(f"The {_NAMES[kind]} is {size} bytes, more than this server's limit of "
                             f"{limits.max_bytes} (--grammar-max-bytes raises it).")
    if kind == "json":
        depth, alternatives = json_shape(text, limits.max_depth)
        if depth > limits.max_depth:
            raise GrammarRefused(depth_message(depth, limits.max_depth))
    elif kind == "choice":
        depth, alternatives = 1, len(json.loads(text))
    elif kind in ("regex", "grammar"):
        check_repetitions(_NAMES[kind], text)
        depth, alternatives = _text_shape(text, quotes=kind == "grammar")
    else:
        return
    if depth > limits.max_depth:
        raise GrammarRefused(f"The {_NAMES[kind]} nests {depth} levels deep, more than this server's limit of "
                             f"{limits.max_depth} (--grammar-max-depth raises it).")
    if alternatives > limits.max_alternatives:
        raise GrammarRefused(f"The {_NAMES[kind]} has {alternatives} alternatives, more than this server's limit "
                             f"of {limits.max_alternatives} (--grammar-max-alternatives raises it).")


_NAMES = {"json": "JSON schema", "choice": "choice list", "regex": "regular expression", "grammar": "grammar",
          "json_object": "JSON object constraint"}


def _text_shape(text: str, quotes: bool) -> tuple[int, int]:
    """(parenthesis depth, '|' count + 1) of a regex or an EBNF grammar in one pass; escapes, character
    classes and (in grammars) quoted literals are skipped."""
    depth = deepest = alternatives = 0
    closing = ""                      # inside a class or literal: the character that ends it
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif closing:
            closing = "" if ch == closing else closing
        elif ch == "[" or (quotes and ch in "\"'"):
            closing = "]" if ch == "[" else ch
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(0, depth - 1)
        elif ch == "|":
            alternatives += 1
    return deepest, alternatives + 1
