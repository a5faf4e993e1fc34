"""Structured outputs, tool calling and the Responses API against a real `stagewise serve` on the
default model, driven by the real clients unchanged: openai SDK (`parse`, tools, streaming,
responses), LangChain (`with_structured_output` each method, `bind_tools`), LiteLLM and an
openai-agents agent over Chat Completions and Responses. Plus the PP=2 server (tiny model) and
bad input (400 in the OpenAI shape, the server keeps serving)."""
from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Color(str, Enum):
    red = "red"
    green = "green"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    color: Color
    tags: list[Annotated[str, Field(max_length=10)]] = Field(max_length=2)
    age: Optional[Annotated[int, Field(ge=0, le=30)]] = None


class Owner(BaseModel):
    owner: str = Field(max_length=16)
    pets: list[Pet] = Field(max_length=2)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["C", "F"]


@pytest.fixture(scope="module")
def default_server(launch, tmp_path_factory):
    from stagewise.model.source import resolve_model
    srv = launch(resolve_model(None), tmp_path_factory.mktemp("structured"), "--prefill-graph", "off")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(default_server):
    from openai import OpenAI
    with OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        c.model_name = c.models.list().data[0].id
        yield c


def test_parse_nested_model_20_seeds(oai):
    choices = []
    for seed in (7, 8):                    # n=10 twice: 20 seeds in two batched requests
        choices += oai.chat.completions.parse(model=oai.model_name, response_format=Owner, temperature=1.0, seed=seed,
                                              messages=[{"role": "user", "content": "Describe a pet owner."}],
                                              n=10, max_tokens=250).choices
    for c in choices:
        assert isinstance(c.message.parsed, Owner), c.message.content
        assert c.finish_reason == "stop"


def test_json_object_regex_and_choice(oai):
    r = oai.chat.completions.create(model=oai.model_name, messages=ASK, response_format={"type": "json_object"},
                                    max_tokens=120, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")
    r = oai.chat.completions.create(model=oai.model_name, messages=ASK, max_tokens=20,
                                    extra_body={"structured_outputs": {"regex": r"[0-9]{2}(C|F)"}})
    assert r.choices[0].message.content[:2].isdigit() and r.choices[0].message.content[2] in "CF"
    r = oai.completions.create(model=oai.model_name, prompt="Sunny or rainy?", max_tokens=5,
                               extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].text in ("sunny", "rainy")


def test_streamed_structured_output_parses(oai):
    with oai.chat.completions.stream(model=oai.model_name, messages=ASK, response_format=Weather,
                                     max_tokens=60, temperature=0) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Weather)


def test_required_tool_call_always_parses_20_seeds(oai):
    choices = []
    for seed in (3, 4):
        choices += oai.chat.completions.create(model=oai.model_name, messages=ASK, tools=[WEATHER], n=10, seed=seed,
                                               tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                               max_tokens=120).choices
    for c in choices:
        assert c.finish_reason == "tool_calls"
        assert len(c.message.tool_calls) == 1             # parallel_tool_calls false: one call
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id
        Weather.model_validate_json(call.function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble(oai, choice):
    kw = dict(model=oai.model_name, messages=ASK, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=80)
    whole = oai.chat.completions.create(**kw).choices[0]
    name, args, reason, first_has_name = None, "", None, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        for tc in d.tool_calls or ():
            if first_has_name is None:
                first_has_name = tc.function.name is not None and tc.id is not None
            name = name or tc.function.name
            args += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert first_has_name
    assert (name, json.loads(args), reason) == (whole.message.tool_calls[0].function.name,
                                                json.loads(whole.message.tool_calls[0].function.arguments),
                                                whole.finish_reason) and reason == "tool_calls"


def test_history_with_tool_calls_and_tool_messages(oai):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    r = oai.chat.completions.create(model=oai.model_name, messages=history, tools=[WEATHER], max_tokens=20,
                                    temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain(default_server, oai):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=oai.model_name, base_url=default_server.url + "/v1", api_key="unused", temperature=0,
                     max_tokens=80, max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke("Weather in Rome?")
        assert isinstance(out, Weather), method
    import openai
    try:       # json_mode is any JSON object: a small model may still be writing keys at max_tokens
        out = llm.with_structured_output(None, method="json_mode").invoke("Weather in Rome, as JSON?")
        assert isinstance(out, dict)
    except openai.LengthFinishReasonError as exc:
        assert exc.completion.choices[0].message.content.startswith("{")
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}


def test_litellm(default_server, oai):
    import litellm
    kw = dict(model=f"openai/{oai.model_name}", api_base=default_server.url + "/v1", api_key="unused",
              messages=ASK, max_tokens=80, temperature=0)
    r = litellm.completion(response_format=Weather, **kw)
    Weather.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(tools=[WEATHER], tool_choice="required", **kw)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    Weather.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agents_sdk_agent_calls_a_function_tool(default_server, oai, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is 21 C and sunny in {city}."

    client = AsyncOpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)
    model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(oai.model_name, client)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0,
                                               parallel_tool_calls=False),     # one call: the grammar allows no second
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(cities) == 1 and result.final_output == f"It is 21 C and sunny in {cities[0]}."


def test_responses_api(oai):
    r = oai.responses.create(model=oai.model_name, instructions="Be brief.", input="Say hello.",
                             max_output_tokens=8, temperature=0)
    assert r.output_text and r.usage.output_tokens <= 8
    r = oai.responses.parse(model=oai.model_name, input="Weather in Oslo?", text_format=Weather, max_output_tokens=60,
                            temperature=0)
    assert isinstance(r.output_parsed, Weather)
    events = list(oai.responses.create(model=oai.model_name, input="Say hello.", max_output_tokens=8, stream=True,
                                       temperature=0))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == r.output_text or text == events[-1].response.output_text
    with pytest.raises(Exception, match="previous_response_id"):
        oai.responses.create(model=oai.model_name, input="x", previous_response_id="resp_1")


def test_bad_input_is_400_and_the_server_keeps_serving(oai):
    import openai
    bad = [dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
           dict(extra_body={"structured_outputs": {"regex": "(ab"}}),
           dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tools=[{"type": "function", "function": {"parameters": {}}}])]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=oai.model_name, messages=ASK, max_tokens=5, **kw)
        err = info.value.body
        assert set(err) >= {"message", "type", "param", "code"} and err["message"].endswith(".")
    assert oai.chat.completions.create(model=oai.model_name, messages=ASK, max_tokens=3).choices[0].message.content
