"""gpt-oss's harmony format read back from generated text: analysis -> reasoning_content, final ->
content, `to=functions.NAME` messages -> tool calls; streams split at every boundary add up to the
whole reply; the chat shape's body and stream chunks; the gpt-oss chat template renders tools and
tool results."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from stagewise.request import CompletionOutput, RequestOutput
from stagewise.server.formatting import ChatShape
from stagewise.server.harmony import HarmonyStream, final_message, parse
from stagewise.server.tools import final_calls

TEMPLATE = Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja"
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "unit": "C"}<|call|>')
CALL2 = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 21 C in Paris.<|return|>"
# every special token as the decoder writes it, and the text between them, as separate pieces
PIECES_OF = __import__("re").compile(r"(<\|[a-z]+\|>)")


def pieces(text: str) -> list[str]:
    """The text cut the way tokens could cut it: at every special token and between every character."""
    out = []
    for part in PIECES_OF.split(text):
        out += [part] if part.startswith("<|") else list(part)
    return [p for p in out if p]


def test_analysis_then_final():
    content, reasoning, calls = final_message(ANALYSIS + FINAL, True)
    assert (content, reasoning, calls) == ("It is 21 C in Paris.", "The user wants the weather. Call the tool.", [])


def test_several_tool_calls_after_reasoning():
    content, reasoning, calls = final_message(ANALYSIS + CALL + CALL2, True)
    assert content is None and reasoning.startswith("The user wants")
    assert calls == [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", '{"tz": "CET"}')]
    # without tools the calls are not turned into tool_calls (and the text is not shown as content)
    assert final_message(ANALYSIS + CALL, False) == ("", "The user wants the weather. Call the tool.", [])


def test_plain_text_and_a_reply_cut_short():
    assert final_message("just words", True) == ("just words", None, [])
    cut = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 2"
    assert final_message(cut, True) == ("It is 2", "The user wants the weather. Call the tool.", [])
    # a header not yet closed by <|message|> says nothing yet
    assert parse(ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_w", False).calls == []


def test_the_tool_parser_entry_reads_harmony():
    content, calls = final_calls("auto", "harmony", ANALYSIS + CALL)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]


def _streamed(text: str, tools_on: bool = True) -> dict:
    """Feed `text` piece by piece; merge the deltas the way a client does."""
    hs, got = HarmonyStream(tools_on, "call_x"), {"reasoning_content": "", "content": "", "calls": {}}
    ps = pieces(text)
    for k in range(1, len(ps) + 1):
        for d in hs.deltas("".join(ps[:k]), k == len(ps)):
            for key in ("reasoning_content", "content"):
                got[key] += d.get(key, "")
            for tc in d.get("tool_calls", []):
                entry = got["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                entry["name"] += tc["function"].get("name", "")
                entry["arguments"] += tc["function"].get("arguments", "")
    return got


@pytest.mark.parametrize("text", [ANALYSIS + FINAL, ANALYSIS + CALL + CALL2, CALL, FINAL[len("<|start|>assistant"):],
                                  ANALYSIS + "<|start|>assistant<|channel|>final<|message|>a <|x b"])
def test_streaming_split_at_every_boundary_gives_the_whole_reply(text):
    content, reasoning, calls = final_message(text, True)
    got = _streamed(text)
    assert got["content"] == (content or "") and got["reasoning_content"] == (reasoning or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())] == calls


def test_streaming_holds_back_a_special_token_cut_at_the_end():
    hs = HarmonyStream(True, "c")
    assert hs.deltas("<|channel|>final<|message|>Hi<|re", False) == [{"content": "Hi"}]
    assert hs.deltas("<|channel|>final<|message|>Hi<|return|>", True) == []


def _out(text: str, finished: bool = True, reason: str | None = "stop") -> RequestOutput:
    return RequestOutput("req-harmony-0001", None, [1, 2], [CompletionOutput(0, text, [], finish_reason=reason)],
                         finished=finished)


def _shape(tool_mode: str) -> ChatShape:
    serving = SimpleNamespace(tok=None, tool_call_parser="harmony", model_name="gpt-oss-tiny", lora_names=(),
                              usage=lambda inputs, finals, n: {})
    req = SimpleNamespace(n=1, stream_options=None, logprobs=False, echo=False, model=None,
                          return_tokens_as_token_ids=None, prompt_logprobs=None, skip_special_tokens=None)
    return ChatShape(serving, req, [{"role": "user", "content": "hi"}], tool_mode)


def test_chat_body_and_stream_chunks_for_a_tool_call():
    text = ANALYSIS + CALL
    msg, reason = _shape("auto").message(_out(text))
    assert reason == "tool_calls" and msg["content"] is None
    assert msg["reasoning_content"] == "The user wants the weather. Call the tool."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Paris", "unit": "C"}')]
    shape, chunks = _shape("auto"), []
    ps = pieces(text)
    for k in range(1, len(ps) + 1):
        chunks += shape.chunks(0, _out("".join(ps[:k]), k == len(ps), "stop" if k == len(ps) else None))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
    assert args == msg["tool_calls"][0]["function"]["arguments"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["tool_calls"]


def test_chat_body_without_tools_splits_the_channels():
    msg, reason = _shape("none").message(_out(ANALYSIS + FINAL))
    assert (msg["content"], reason) == ("It is 21 C in Paris.", "stop")
    assert msg["reasoning_content"] and "tool_calls" not in msg


def test_the_gpt_oss_template_renders_tools_calls_and_results():
    """What the server hands the template: tools, an assistant call (arguments as an object) and the
    tool's result; the prompt ends ready for the assistant's next channel."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template
    assert jinja2
    template = _compile_jinja_template(TEMPLATE.read_text())
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    text = template.render(messages=messages, tools=tools, add_generation_prompt=True,
                           strftime_now=lambda f: "2026-01-01")
    assert "namespace functions" in text and "type get_weather" in text
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>' in text
    assert text.endswith("<|start|>assistant")
    # and the call the model writes in that format parses back to the same call
    assert final_message("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                         '{"city": "Paris"}<|call|>', True)[2] == [("get_weather", '{"city": "Paris"}')]
