"""What a constraint may be and what compiling it may cost (`GrammarLimits`, from the engine config),
and the check of a constraint's text against them: size, nesting depth and number of alternatives.

The check is linear in the text and needs no grammar backend, so the server runs it once per request
on an intake thread (a 400 naming the limit and its flag) and the compile supervisor runs it again
before compiling. What no cheap check can bound (a regex that compiles for minutes, or to gigabytes)
the compile budgets bound (grammar/compiler.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON Schema keywords whose list items are alternatives to choose among
_ALTERNATIVE_KEYWORDS = ("anyOf", "oneOf", "enum", "type")
_DATA_KEYWORDS = ("const", "enum", "default", "examples")      # their values are data, not schemas
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                   "minContains", "maxContains")


class GrammarRefused(ValueError):
    """A constraint the server will not compile: `status` 400 (bad or too large), 408 (over its time
    budget) or 503 (the compiler is unavailable); the message names the limit and its flag."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 << 10
    max_depth: int = 64
    max_alternatives: int = 1024
    compile_timeout_s: float = 10.0
    memory: int = 1 << 30                 # all compile workers together
    workers: int = 2
    cache_entries: int = 256
    cache_memory: int = 256 << 20         # kept compiled grammars together; also the largest one

    @classmethod
    def of(cls, config) -> "GrammarLimits":
        return cls(config.grammar_max_bytes, config.grammar_max_depth, config.grammar_max_alternatives,
                   config.grammar_compile_timeout_s, config.grammar_memory, config.grammar_compile_workers,
                   config.grammar_cache_entries, config.grammar_cache_memory)

    @property
    def memory_per_compile(self) -> int:
        return self.memory // self.workers


def check_limits(kind: str, text: str, limits: GrammarLimits) -> None:
    """Raise GrammarRefused when the constraint `text` of `kind` (StructuredOutputs.key) is larger,
    deeper or has more alternatives than `limits` allow."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise GrammarRefused(f"The {_NAMES[kind]} is {size} bytes, more than this server's limit of "
                             f"{limits.max_bytes} (--grammar-max-bytes raises it).")
    if kind == "json":
        depth, alternatives = _json_shape(text)
    elif kind == "choice":
        depth, alternatives = 1, len(json.loads(text))
    elif kind in ("regex", "grammar"):
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


def _json_shape(text: str) -> tuple[int, int]:
    """(nesting depth, alternatives) of a JSON schema document, walked without recursion."""
    try:
        doc = json.loads(text)
    except RecursionError:
        return 1 << 30, 0
    except ValueError as exc:
        raise GrammarRefused(f"The JSON schema is not valid JSON ({exc}); give a JSON schema.") from None
    if not isinstance(doc, (dict, bool)):
        raise GrammarRefused("The JSON schema must be a JSON object (or true / false).")
    deepest, alternatives = 0, 0
    stack: list[tuple[Any, int, bool]] = [(doc, 1, False)]        # (node, depth, is it data, not schema)
    while stack:
        node, depth, is_data = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            if not is_data:
                alternatives += sum(len(v) for k, v in node.items() if k in _ALTERNATIVE_KEYWORDS
                                    and isinstance(v, list))
                _check_counts(node)
            stack.extend((v, depth + 1, is_data or k in _DATA_KEYWORDS) for k, v in node.items()
                         if isinstance(v, (dict, list)))
        else:
            stack.extend((v, depth + 1, is_data) for v in node if isinstance(v, (dict, list)))
    return deepest, alternatives


def _check_counts(schema: dict) -> None:
    """JSON Schema's length and count keywords must be non-negative integers (a map of property
    schemas may name a property so: its value is an object)."""
    for key in _COUNT_KEYWORDS:
        value = schema.get(key)
        if value is None or isinstance(value, (dict, list)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise GrammarRefused(f"The JSON schema's {key} is {json.dumps(value)[:40]}; it must be a non-negative "
                                 f"integer.")


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
