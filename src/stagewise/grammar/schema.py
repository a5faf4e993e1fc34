"""The JSON schema part of the limit check (grammar/limits.py): a walk over the schema that knows
which keywords hold schemas, so that nesting is counted as users count it (one level per schema
inside another, or per object or array inside a const or enum; `properties` itself is no level),
and that refuses what xgrammar would accept without enforcing: the output could break it."""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from .refusals import GrammarRefused, check_repetitions

# keywords whose value is one schema, a map of names to schemas, or a list of schemas
_ONE_SCHEMA = frozenset(("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
                         "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else"))
_SCHEMA_MAP = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
_SCHEMA_LIST = frozenset(("anyOf", "oneOf", "allOf", "prefixItems", "items"))
_ALTERNATIVE_KEYWORDS = ("anyOf", "oneOf", "enum", "type")     # their list items are alternatives
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                   "minContains", "maxContains")
# xgrammar 0.2.9 compiles these and ignores them (tests/engine/test_grammar_service.py shows it)
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "minContains",
            "maxContains", "$dynamicRef")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]")
Node = tuple[Any, int, bool, str]                 # (value, depth, is it a schema, where)


def json_shape(text: str, max_depth: int) -> tuple[int, int]:
    """(nesting depth, alternatives) of a JSON schema document, walked without recursion; a
    GrammarRefused for a keyword xgrammar would not enforce or a bad count."""
    doc = _parse(text, max_depth)
    deepest, alternatives = 0, 0
    stack: list[Node] = [(doc, 1, True, "the root")]
    while stack:
        node, depth, is_schema, where = stack.pop()
        deepest = max(deepest, depth)
        if is_schema and isinstance(node, dict):
            _check_keywords(node, where)
            alternatives += sum(len(v) for k, v in node.items() if k in _ALTERNATIVE_KEYWORDS and isinstance(v, list))
            stack.extend(_schema_children(node, depth, where))
        elif isinstance(node, (dict, list)):
            values = node.values() if isinstance(node, dict) else node
            stack.extend((v, depth + 1, False, where) for v in values if isinstance(v, (dict, list)))
    return deepest, alternatives


def _parse(text: str, max_depth: int) -> Any:
    try:
        doc = json.loads(text)
    except RecursionError:
        raise GrammarRefused(_too_deep_to_parse(text, max_depth)) from None
    except ValueError as exc:
        raise GrammarRefused(f"The JSON schema is not valid JSON ({exc}); give a JSON schema.") from None
    if isinstance(doc, str):
        raise GrammarRefused("The JSON schema is a JSON string, not an object (was it encoded twice?); send the "
                             "schema object, or its JSON text once.")
    if not isinstance(doc, (dict, bool)):
        raise GrammarRefused("The JSON schema must be a JSON object (or true / false).")
    return doc


def _too_deep_to_parse(text: str, max_depth: int) -> str:
    """A schema nested past what json.loads parses: each level of it is at most two brackets."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    deepest = max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
    if (deepest + 1) // 2 > max_depth:
        return depth_message(f"at least {(deepest + 1) // 2}", max_depth)
    return f"The JSON schema nests {deepest} brackets deep, more than this server can parse; flatten it."


def depth_message(depth: int | str, max_depth: int) -> str:
    return (f"The JSON schema nests {depth} levels deep, more than this server's limit of {max_depth} (a level is "
            f"a schema inside another's properties, items or anyOf, or an object or array inside a const or "
            f"enum; --grammar-max-depth raises it).")


def _schema_children(schema: dict, depth: int, where: str) -> list[Node]:
    """The values below a schema: the schemas its keywords hold, and data (const, enum, unknown keywords)."""
    out: list[Node] = []
    for key, value in schema.items():
        here = f"{where}/{key}" if where != "the root" else f"/{key}"
        if key in _SCHEMA_MAP and isinstance(value, dict):
            out.extend((v, depth + 1, True, f"{here}/{name}") for name, v in value.items())
        elif key in _SCHEMA_LIST and isinstance(value, list):
            out.extend((v, depth + 1, True, f"{here}/{i}") for i, v in enumerate(value))
        elif key in _ONE_SCHEMA and isinstance(value, dict):
            out.append((value, depth + 1, True, here))
        elif isinstance(value, (dict, list)):
            out.append((value, depth + 1, False, here))
    return out


def _check_keywords(schema: dict, where: str) -> None:
    """Refuse what xgrammar accepts but does not enforce; counts must be non-negative integers."""
    ignored = next((f"'{k}'" for k in _IGNORED if k in schema), None)
    if ignored is None and schema.get("uniqueItems") is True:
        ignored = "'uniqueItems'"
    if ignored is None and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        ignored = "'allOf' with more than one schema"
    if ignored is None and "multipleOf" in schema and not _integer_multiple(schema):
        ignored = "'multipleOf' outside an integer schema"
    if ignored is not None:
        raise GrammarRefused(f"The JSON schema uses {ignored} (at {where}), which this server's grammar compiler "
                             f"does not enforce, so the output could break it; remove it.")
    _check_counts(schema)
    if isinstance(schema.get("pattern"), str):
        check_repetitions(f"JSON schema's pattern at {where}", schema["pattern"])


def _integer_multiple(schema: dict) -> bool:
    value = schema["multipleOf"]
    return schema.get("type") == "integer" and isinstance(value, int) and not isinstance(value, bool)


def _check_counts(schema: dict) -> None:
    """JSON Schema's length and count keywords must be non-negative integers."""
    for key in _COUNT_KEYWORDS:
        value = schema.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
            raise GrammarRefused(f"The JSON schema's {key} is {json.dumps(value)[:40]}; it must be a non-negative "
                                 f"integer.")
