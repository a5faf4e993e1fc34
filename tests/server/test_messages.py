"""Messages that said the wrong thing (issue 42, item 7): an IPv4-mapped loopback Host is loopback,
an over-long stop string is named by its index and length, a function_call item whose name is not
a string says so."""
from __future__ import annotations

import json

import pytest

from stagewise.server.errors import APIError
from stagewise.server.guard import host_name, is_loopback_name
from stagewise.server.intake import parse_request
from stagewise.server.protocol import CompletionRequest
from stagewise.server.responses import ResponsesRequest, input_messages


@pytest.mark.parametrize("host", ["[::ffff:127.0.0.1]", "[::ffff:127.0.0.1]:8000", "[::1]", "127.0.0.2:80"])
def test_ipv4_mapped_loopback_hosts_are_loopback(host):
    assert is_loopback_name(host_name(host))


@pytest.mark.parametrize("host", ["[::ffff:10.0.0.1]", "[::ffff:127.0.0.1]evil.com", "evil.com"])
def test_other_hosts_are_not(host):
    assert not is_loopback_name(host_name(host))


@pytest.mark.parametrize("stop, index, length", [(["x" * 513], 0, 513), (["a", "b" * 600], 1, 600)])
def test_a_long_stop_string_is_named_by_its_index_and_length(stop, index, length):
    with pytest.raises(APIError) as info:
        parse_request(json.dumps({"prompt": "hi", "stop": stop}).encode(), CompletionRequest)
    message = info.value.message
    assert f"stop[{index}] has {length} characters" in message and "512" in message
    assert "items" not in message and "Value error" not in message and info.value.param == "stop"


def test_a_function_call_name_that_is_not_a_string_says_so():
    req = ResponsesRequest(input=[{"type": "function_call", "name": 5, "call_id": "c1", "arguments": "{}"}])
    with pytest.raises(APIError) as info:
        input_messages(req)
    assert "must be a string" in info.value.message and "without a name" not in info.value.message
    assert info.value.param == "input.0.name"
