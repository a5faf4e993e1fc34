"""gpt-oss through `stagewise serve` with the openai client: a tiny random gpt-oss whose tokenizer
carries harmony's special tokens and the gpt-oss chat template. A random model writes no harmony by
itself, so a regex (structured outputs) makes it write an analysis message and a tool call, as a
trained one would; the server turns that text into reasoning_content and tool_calls, whole and
streamed, and renders the tool's result in the next turn."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
REPLY = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gpt_oss_harmony_dir(tmp_path_factory, tiny_tokenizer_dir):
    from tokenizers import Tokenizer

    from tests.conftest import build_tiny_checkpoint
    tok_dir = tmp_path_factory.mktemp("harmony-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_tokenizer_dir / name, tok_dir / name)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens(HARMONY)
    tok.save(str(tok_dir / "tokenizer.json"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["additional_special_tokens"] = list(config.get("additional_special_tokens", [])) + HARMONY
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    out = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gpt-oss-harmony"), "gpt_oss", tok_dir)
    # the template writes today's date into the prompt; a fixed one keeps the tiny random model's choices
    # (a harmony marker as its special token or spelled out, both matching the forced text) the same every day
    template = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text()
    (out / "chat_template.jinja").write_text(template.replace('strftime_now("%Y-%m-%d")', '"2026-12-07"'))
    return out


@pytest.fixture(scope="module")
def oai(launch, gpt_oss_harmony_dir, tmp_path_factory):
    from openai import OpenAI
    srv = launch(gpt_oss_harmony_dir, tmp_path_factory.mktemp("harmony-server"), "--prefill-graph", "off")
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as client:
            client.model_name = client.models.list().data[0].id
            yield client
    finally:
        srv.stop()


def _forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_chat_with_tools_gives_reasoning_and_a_tool_call(oai):
    r = oai.chat.completions.create(model=oai.model_name, messages=ASK, tools=TOOLS, max_tokens=220,
                                    extra_body=_forced(REPLY))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    # streamed: the same reasoning and call, in deltas per channel
    reasoning, args, names, reasons = "", "", [], []
    for chunk in oai.chat.completions.create(model=oai.model_name, messages=ASK, tools=TOOLS, max_tokens=220,
                                             stream=True, extra_body=_forced(REPLY)):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        assert not delta.content
        for tc in delta.tool_calls or []:
            names += [tc.function.name] if tc.function.name else []
            args += tc.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (reasoning, names, json.loads(args), reasons) == ("Need the weather.", ["get_weather"],
                                                              {"city": "Paris"}, ["tool_calls"])

    # the tool's result goes back; the model's final answer is the content
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
    final = "<|channel|>final<|message|>21 C in Paris.<|return|>"
    r = oai.chat.completions.create(model=oai.model_name, messages=history, tools=TOOLS, max_tokens=160,
                                    extra_body=_forced(final))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("21 C in Paris.", "stop")
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 40          # the developer message with the tools and the tool result


@pytest.mark.parametrize("stop", ["<|call|>", "<|return|>"])
def test_call_and_return_end_the_turn(oai, gpt_oss_harmony_dir, stop):
    """The model is pushed to write the token at once: the turn ends there (without harmony's stop
    tokens it would write it until max_tokens)."""
    from tokenizers import Tokenizer
    token_id = Tokenizer.from_file(str(gpt_oss_harmony_dir / "tokenizer.json")).token_to_id(stop)
    r = oai.chat.completions.create(model=oai.model_name, messages=ASK, max_tokens=8,
                                    logit_bias={str(token_id): 100})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)


def test_responses_api_reads_harmony_too(oai):
    flat = [dict(TOOLS[0]["function"], type="function")]
    r = oai.responses.create(model=oai.model_name, input="What is the weather in Paris?", tools=flat,
                             max_output_tokens=220, extra_body=_forced(REPLY))
    [item] = r.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    events = list(oai.responses.create(model=oai.model_name, input="Weather?", max_output_tokens=150, stream=True,
                                       extra_body=_forced(answer)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sunny."
    assert events[-1].response.output[0].content[0].text == "Sunny."


def test_reasoning_effort_reaches_the_template(oai):
    """The prompt of a chat with reasoning_effort is the template's with that effort (as /tokenize
    renders it with the template variable), and another effort makes another prompt."""
    import httpx
    base = str(oai.base_url).removesuffix("/v1/").removesuffix("/v1")
    counts = {}
    for effort in ("low", "high and thorough, step by step"):
        r = oai.chat.completions.create(model=oai.model_name, messages=ASK, max_tokens=1, reasoning_effort=effort)
        want = httpx.post(base + "/tokenize", json={"messages": ASK, "chat_template_kwargs":
                                                   {"reasoning_effort": effort}}, timeout=30).json()["count"]
        counts[effort] = r.usage.prompt_tokens
        assert r.usage.prompt_tokens == want
    assert len(set(counts.values())) == 2
