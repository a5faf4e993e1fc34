"""Raw request body -> validated request object, on an intake thread: JSON parsing (pydantic's
parser: strict UTF-8, no lone surrogates, nesting up to 200) and schema validation, with the
cyclic garbage collector paused meanwhile. Any problem is a 400 naming the field."""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

import pydantic_core
from pydantic import BaseModel, ValidationError

from .errors import bad_request, from_validation_error


def parse_request(body: bytes, schema: type[BaseModel]):
    """A request object from the raw body (UTF-8 JSON); any problem is a 400 naming the field.
    Lone surrogate escapes ("\\ud800"), invalid UTF-8 and nesting deeper than 200 are invalid JSON."""
    with _gc_paused():
        try:
            data = pydantic_core.from_json(body)
        except ValueError as exc:
            raise bad_request(f"The request body is not valid JSON ({exc}); send one JSON object in UTF-8 (lone "
                              f"surrogate escapes such as \\ud800 are not text).", code="invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request(f"The request body must be a JSON object, not {_JSON_TYPES.get(type(data), 'that')}.")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextmanager
def _gc_paused():
    """No cyclic garbage collection while a body is parsed and validated (by any intake thread).
    A body can hold a million arrays, all alive until the request ends; collections triggered while
    they are built would rescan them again and again, holding the GIL for seconds. JSON has no cycles."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        _gc_pausers += 1
        if _gc_pausers == 1:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}
