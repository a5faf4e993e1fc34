"""Property-based fuzzing of the HTTP routes on the scratch server: random JSON values, types and
nesting for every field of /v1/completions, /v1/chat/completions and /generate (field names
from the schemas). No answer is a 5xx, /health stays 200 between examples, and a greedy request
gives the same tokens after the fuzzing as before. Seeded and bounded (derandomize, a fixed
example count), so it is the same run every time."""
from __future__ import annotations

import json

import pytest
from http_checks import JSON, assert_serving, httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from stagewise.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, NativeSampling

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
SCHEMAS = {C: CompletionRequest, CHAT: ChatCompletionRequest, GEN: GenerateRequest}
# NOTE: small max_tokens in every base, so a fuzzed body that happens to be valid finishes fast.
BASE = {C: {"prompt": "Hi", "max_tokens": 2},
        CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "max_completion_tokens": 2},
        GEN: {"text": "Hi", "sampling_params": {"max_tokens": 2}}}
EXAMPLES_PER_ROUTE = 120

texts = st.text(st.characters(exclude_categories=[]), max_size=12) | st.sampled_from(
    ["\ud800", "a\udc00b", "\u2028\u2029\u0085", "", "\x00", "\U0001d54f", "user", "text", "none"])
numbers = (st.integers() | st.floats() | st.sampled_from([0, 1, -1, 16, 17, 65, 2**63, -2**63 - 1, 10**30,
                                                          1e-300, 5e-324, 1e308, -0.0]))
scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"])
                                           | json_values},
                                          optional={"content": json_values, "name": json_values}), max_size=3)


@st.composite
def bodies(draw, path: str) -> dict:
    fields = sorted(SCHEMAS[path].model_fields) + ["unknown_field"]
    body = dict(BASE[path])
    body.update(draw(st.dictionaries(st.sampled_from(fields), json_values, max_size=3)))
    if path == CHAT and draw(st.booleans()):
        body["messages"] = draw(messages)
    if path == GEN and draw(st.booleans()):
        sampling = draw(st.dictionaries(st.sampled_from(sorted(NativeSampling.model_fields)), json_values,
                                        max_size=3))
        body["sampling_params"] = {"max_tokens": 2, **sampling}
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
