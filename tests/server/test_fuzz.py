"""Property-based fuzzing of the HTTP routes on the scratch server: random JSON values, types and
nesting for every field of /v1/completions, /v1/chat/completions and /generate (field names
from the schemas). No answer is a 5xx, /health stays 200 between examples, and a greedy request
gives the same tokens after the fuzzing as before. Seeded and bounded (derandomize, a fixed
example count), so it is the same run every time."""
from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Literal

import pytest
from http_checks import JSON, assert_serving, httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from stagewise.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

pytestmark = pytest.mark.slow

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
SCHEMAS = {C: CompletionRequest, CHAT: ChatCompletionRequest, GEN: GenerateRequest}
# NOTE: small max_tokens in every base, so a fuzzed body that happens to be valid finishes fast.
BASE = {C: {"prompt": "Hi", "max_tokens": 2},
        CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "max_completion_tokens": 2},
        GEN: {"text": "Hi", "sampling_params": {"max_tokens": 2}}}
EXAMPLES_PER_ROUTE = 100

# NOTE: a lone surrogate makes the whole body invalid JSON; kept rare so most bodies get further.
texts = st.text(max_size=12) | st.sampled_from(["user", "text", "none", "\u2028\u2029\u0085", "", "\x00",
                                                "\U0001d54f", *(f"w{i}" for i in range(12)), "a\udc00b"])
ints = st.integers() | st.integers(-2, 70) | st.sampled_from([16, 17, 65, 511, 512, 2**63, -2**63 - 1, 10**30])
floats = st.floats() | st.sampled_from([1e-300, 5e-324, 1e-45, 1e-5, 1e308, -0.0, 0.5, 2.0])
scalars = st.none() | st.booleans() | ints | floats | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)


def typed(tp) -> st.SearchStrategy:
    """Values of the JSON shape a schema annotation describes (edge values included), so that many
    fuzzed bodies get past the type checks and reach the engine."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return typed(args[0])
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed(a) for a in args])
    if origin is list:
        return st.lists(typed(args[0]), max_size=4)
    if origin is dict:
        return st.dictionaries(texts, typed(args[1]), max_size=3)
    if origin is Literal:
        return st.sampled_from(args)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_bodies(tp)
    scalars = {int: ints, float: ints | floats, bool: st.booleans(), str: texts, type(None): st.none()}
    return scalars.get(tp, json_values)


def values_for(tp) -> st.SearchStrategy:
    return st.one_of(typed(tp), typed(tp), json_values)        # two thirds well typed, a third anything


def model_bodies(model: type[BaseModel]) -> st.SearchStrategy:
    fields = model.model_fields
    return st.fixed_dictionaries({k: values_for(f.annotation) for k, f in fields.items() if f.is_required()},
                                 optional={k: st.deferred(lambda f=f: values_for(f.annotation))
                                           for k, f in fields.items() if not f.is_required()})


@st.composite
def bodies(draw, path: str) -> dict:
    fields = SCHEMAS[path].model_fields
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(values_for(fields[name].annotation))
    if path == GEN and isinstance(body.get("sampling_params"), dict):
        body["sampling_params"].setdefault("max_tokens", 2)
    return body


@pytest.fixture(scope="module")
def greedy_before(scratch_server):
    return assert_serving(scratch_server.url)


def _fuzz(path: str):
    @settings(derandomize=True, deadline=None, max_examples=EXAMPLES_PER_ROUTE, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def check(url: str, body: dict):
        raw = json.dumps(body).encode()          # NaN, Infinity and lone surrogates as JSON escapes
        r = httpx.post(url + path, content=raw, headers=JSON, timeout=60)
        assert r.status_code < 500, (r.status_code, r.text[:500], body)
        assert '"server_error"' not in r.text, (r.text[:500], body)     # streams carry errors as events
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200, (health.text, body)
    return check


@pytest.mark.parametrize("path", [C, CHAT, GEN])
def test_fuzzed_requests_never_5xx(scratch_server, greedy_before, path):
    _fuzz(path)(scratch_server.url)


def test_greedy_tokens_unchanged_after_fuzzing(scratch_server, greedy_before):
    assert assert_serving(scratch_server.url) == greedy_before
