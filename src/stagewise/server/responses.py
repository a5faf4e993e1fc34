"""The Responses API (`POST /v1/responses`), stateless: text or message-item `input`, `instructions`,
`max_output_tokens`, sampling fields, `text.format` (structured output), function `tools` and
`tool_choice`, and streaming with the Responses event types. Input items become a chat
conversation (function calls and their outputs as assistant tool calls and tool messages), so it
runs through the same template, grammar and tool-call parsing as chat completions.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from ..request import RequestOutput
from .errors import bad_request
from .formatting import Shape
from .harmony import HarmonyStream
from .protocol import Anys, Finite, Int, StructuredFields, _Lenient, response_format_spec
from .tools import ToolStream, final_calls


class ResponsesRequest(_Lenient, StructuredFields):
    """Unknown fields are dropped with one warning per name, as on the other OpenAI routes."""
    model: str | None = None
    input: str | Anys
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    seed: Int | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: Anys | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    # accepted and ignored: they tag, route or shape nothing this server computes
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: Anys | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: Int | None = None
    top_logprobs: Int | None = None

    def check_unsupported(self) -> None:
        if self.previous_response_id is not None or self.conversation is not None:
            name = "previous_response_id" if self.previous_response_id is not None else "conversation"
            raise bad_request(f"{name} is not supported: this server stores no responses; send the whole "
                              f"conversation as input items instead.", name, "unsupported")
        if self.prompt is not None:
            raise bad_request("prompt (stored prompt templates) is not supported; send input and instructions.",
                              "prompt", "unsupported")
        if self.background:
            raise bad_request("background responses are not supported (nothing is stored); leave background "
                              "false.", "background", "unsupported")

    def sampling_kwargs(self) -> dict:
        return {k: v for k in ("temperature", "top_p", "seed") if (v := getattr(self, k)) is not None}

    def format_spec(self) -> dict | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise bad_request("text.format must be an object such as {\"type\": \"json_schema\", ...}.",
                              "text.format")
        return fmt


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts.", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}] is a {kind!r} part; this server accepts only text parts.",
                              f"{where}.content", "unsupported")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` + `input` as chat-template messages."""
    msgs: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if not req.input:
        raise bad_request("input is empty; give the text or at least one input item.", "input")
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or a function call item).", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}.",
                                  f"input.{i}.role")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name = item.get("name")
            if name is not None and not isinstance(name, str):
                raise bad_request(f"{where}.name must be a string (the name of the function it called), got "
                                  f"{name!r:.80}.", f"input.{i}.name")
            if not name:
                raise bad_request(f"{where} is a function_call item without a name; give the name of the function "
                                  f"it called.", f"input.{i}.name")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where} is a {kind!r} item; this server accepts message, function_call and "
                              f"function_call_output items.", f"input.{i}.type", "unsupported")
    return msgs


def _arguments(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


class ResponsesShape(Shape):
    """Response objects and the stream's events (response.created ... response.completed)."""

    def __init__(self, serving, req: ResponsesRequest, tools: list[dict], mode: str, max_tokens: int):
        super().__init__(serving, None, "resp")
        self.id = f"resp_{uuid.uuid4().hex}"
        self.req, self.tools, self.mode, self.parser = req, tools, mode, serving.tool_call_parser
        self.max_tokens = max_tokens
        self.seq = 0
        self.stream = ToolStream(mode, self.parser)
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.msg_open = False
        self.sent_text = ""
        # gpt-oss: the answer is the final channel of the harmony text (calls come at the end, as for others)
        self.harmony = HarmonyStream(False, "") if self.parser == "harmony" and mode in ("none", "auto") else None

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: str | None = None) -> dict:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model_name, "output": output, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "metadata": r.metadata or {}, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "temperature": r.temperature if r.temperature is not None else 1.0,
                "top_p": r.top_p if r.top_p is not None else 1.0,
                "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
                "tools": [dict(t["function"], type="function", strict=False) for t in self.tools],
                "text": r.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
                "previous_response_id": None, "reasoning": None, "usage": usage}

    def usage(self, inputs, finals) -> dict:
        u = self.serving.usage(inputs, finals, 1)
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def items(self, out: RequestOutput) -> list[dict]:
        mode = "auto" if self.harmony is not None and self.mode == "none" else self.mode
        content, calls = final_calls(mode, self.parser, out.outputs[0].text)
        calls = calls if self.mode != "none" else []
        items = []
        if content:
            items.append(self.message_item(content, "completed"))
        items += [{"type": "function_call", "id": f"fc_{c.id[5:]}", "call_id": c.id, "name": c.name,
                   "arguments": c.arguments, "status": "completed"} for c in calls]
        return items

    def message_item(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status else []
        return {"type": "message", "id": self.msg_id, "status": status or "in_progress", "role": "assistant",
                "content": content}

    def final(self, inputs, finals: list[RequestOutput]) -> dict:
        out = finals[0]
        cut = out.outputs[0].finish_reason == "length"
        return self.response("incomplete" if cut else "completed", self.items(out), self.usage(inputs, finals),
                             "max_output_tokens" if cut else None)

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        return self.final(inputs, finals)

    # streaming
    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st, events = self.state(i), []
        if not st.started:
            st.started = True
            events.append(self.event("response.created", response=self.response("in_progress", [])))
            events.append(self.event("response.in_progress", response=self.response("in_progress", [])))
        st.advance(out)
        if self.harmony is not None:
            delta = "".join(d.get("content", "") for d in self.harmony.deltas(st.text, out.finished))
        else:
            delta = st.text[len(self.sent_text):] if self.mode == "none" else self.stream.content_delta(
                st.text, out.finished)
        if delta:
            if not self.msg_open:
                self.msg_open = True
                events.append(self.event("response.output_item.added", output_index=0,
                                         item=self.message_item("", "")))
                events.append(self.event("response.content_part.added", item_id=self.msg_id, output_index=0,
                                         content_index=0, part={"type": "output_text", "text": "",
                                                                "annotations": [], "logprobs": []}))
            self.sent_text += delta
            events.append(self.event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                     content_index=0, delta=delta, logprobs=[]))
        return events

    def tail(self, inputs, finals) -> list[dict]:
        final = self.final(inputs, finals)
        events, index = [], 0
        for item in final["output"]:
            if item["type"] == "message":
                text = item["content"][0]["text"]
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=self.msg_id, output_index=0,
                                         content_index=0, text=text, logprobs=[]))
                events.append(self.event("response.content_part.done", item_id=self.msg_id, output_index=0,
                                         content_index=0, part=part))
            else:
                added = dict(item, arguments="", status="in_progress")
                events.append(self.event("response.output_item.added", output_index=index, item=added))
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=index, delta=item["arguments"]))
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, arguments=item["arguments"], name=item["name"]))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            index += 1
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self.event(kind, response=final))
        return events


def format_of(req: ResponsesRequest) -> dict | None:
    fmt = req.format_spec()
    return response_format_spec(fmt, "text.format") if fmt is not None else None

