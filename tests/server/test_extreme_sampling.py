"""Sampling values at the edge of float range (tiny temperatures, top_p and penalties, an
infinite temperature with min_tokens) over HTTP: a 4xx or a correct answer, never a dead engine.
Runs on the scratch server so a failure cannot take the shared one down."""
from __future__ import annotations

import pytest
from http_checks import EXTREME_SAMPLING, assert_extreme_sampling_is_safe, httpx

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case,means_greedy", EXTREME_SAMPLING, ids=[c for c, _ in EXTREME_SAMPLING])
def test_extreme_sampling_values(scratch_server, case, means_greedy):
    assert_extreme_sampling_is_safe(scratch_server.url, case, means_greedy)


def test_extreme_values_on_the_openai_routes(scratch_server):
    for path, head in (("/v1/completions", '"prompt": "hi"'),
                       ("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}]')):
        for case, _ in EXTREME_SAMPLING:
            body = '{%s, "max_tokens": 3, %s}' % (head, case)
            r = httpx.post(scratch_server.url + path, content=body.encode(),
                           headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (path, case, r.status_code, r.text)
    assert httpx.get(scratch_server.url + "/health").status_code == 200
