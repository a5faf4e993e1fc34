"""Sampling fields are declared in `request.SamplingParams`; the engine-core wire record
(`core.records.Params`) and the HTTP schemas (`server.protocol`) repeat them. These tests make a
field added in one place and forgotten in another fail: every field needs a sample value here,
crosses the wire alone with its type and its default kept, and is offered by /generate's
`sampling_params` and mapped to the same SamplingParams (the OpenAI schemas: all but the fields
whose shape differs per API, each named below with where it is carried)."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest

from stagewise.core.wire import AddRequests, NewRequest, Params, decode_client, encode
from stagewise.request import SamplingParams
from stagewise.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeSampling,
    SamplingFields,
    make_sampling_params,
)

FIELDS = tuple(f.name for f in fields(SamplingParams))

# a value other than the default that SamplingParams accepts alone, for every field
SAMPLES = {
    "max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1,
    "presence_penalty": 0.5, "frequency_penalty": -0.25, "seed": 7, "stop": ["\n\n", "END"],
    "stop_token_ids": [2, 13], "ignore_eos": True, "logprobs": 5, "prompt_logprobs": 2, "min_tokens": 3,
    "skip_special_tokens": False, "logit_bias": {42: 2.0, 7: -1.5}, "allowed_token_ids": [1, 2, 42],
    "bad_words": ["darn"], "include_stop_str_in_output": True, "truncate_prompt_tokens": -1, "cache_salt": "tenant-a",
    "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    "embed": True, "lora": "adapter-a",
}

# fields no generation schema offers, and who sets them
NOT_GENERATION = {"embed": "/v1/embeddings and LLM.embed",
                  "lora": "the request's model field names the adapter (server.serving.Serving.adapter)"}
GENERATION_FIELDS = tuple(name for name in FIELDS if name not in NOT_GENERATION)

# fields the OpenAI schemas take in a shape of their own (SamplingFields leaves them out), and where
PER_API = {
    "logprobs": "an int in completions, a bool with top_logprobs in chat",
    "prompt_logprobs": "vLLM's extension on both OpenAI requests",
    "structured_outputs": "structured_outputs, guided_* or response_format (StructuredFields)",
}


def test_every_sampling_field_has_a_sample_and_the_wire_record_names_them_all():
    assert set(SAMPLES) == set(FIELDS), "give the new SamplingParams field a sample value here"
    assert Params.__struct_fields__ == FIELDS


def _over_the_wire(params: SamplingParams) -> SamplingParams:
    msg = AddRequests([NewRequest("req-1", [1, 2, 3], None, Params.of(params))])
    back = decode_client(encode(msg))
    assert isinstance(back, AddRequests)
    return back.requests[0].params.to_sampling_params()


@pytest.mark.parametrize("name", FIELDS)
def test_each_field_crosses_the_wire_with_its_value_and_type(name):
    params = SamplingParams(**{name: SAMPLES[name]})
    back = _over_the_wire(params)
    assert back == params
    assert type(getattr(back, name)) is type(getattr(params, name))


def test_the_defaults_cross_the_wire_unchanged():
    assert _over_the_wire(SamplingParams()) == SamplingParams()


def test_the_http_schemas_offer_every_field():
    assert set(NativeSampling.model_fields) >= set(GENERATION_FIELDS), "/generate's sampling_params lacks a field"
    assert set(SamplingFields.model_fields) == set(GENERATION_FIELDS) - set(PER_API)
    for name in PER_API:
        for request in (CompletionRequest, ChatCompletionRequest):
            assert name in request.model_fields, f"{request.__name__} does not carry {name}"


def _from_generate(body: dict) -> SamplingParams:
    """What /generate's route makes of `sampling_params` (routes.py: fields, grammar, max_tokens)."""
    sp = NativeSampling.model_validate(body)
    kwargs = sp.sampling_kwargs()
    grammar, _ = sp.grammar_spec()
    if grammar is not None:
        kwargs["structured_outputs"] = grammar
    max_tokens = sp.max_tokens if sp.max_tokens is not None else SamplingParams().max_tokens
    return make_sampling_params(kwargs, max_tokens, sp.logprobs, prompt_logprobs=sp.prompt_logprobs)


@pytest.mark.parametrize("name", GENERATION_FIELDS)
def test_generate_maps_each_field_to_the_same_sampling_params(name):
    body = json.loads(json.dumps({name: SAMPLES[name]}))      # as a client sends it (logit_bias keys as text)
    assert _from_generate(body) == SamplingParams(**{name: SAMPLES[name]})


def test_generate_keeps_every_default():
    assert _from_generate({}) == SamplingParams()
