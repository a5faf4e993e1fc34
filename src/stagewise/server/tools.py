"""Tool calling: the OpenAI `tools` / `tool_choice` fields checked, chat rendering with tools, the
grammars that make `required` and a named function always parse, and the parsers that find tool
calls in free text (`auto`): Hermes `<tool_call>{...}</tool_call>` JSON (Qwen2/2.5/3, SmolLM-class
templates) and the Llama-3 JSON format. `ToolStream` turns a growing output into content deltas
and, once complete, tool-call deltas (name first, then the arguments).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..request import StructuredOutputs
from .errors import bad_request
from .harmony import final_message as harmony_message

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "harmony")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MAX_TOOLS = 128


@dataclass
class ToolCall:
    name: str
    arguments: str                                      # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: list | None, param: str = "tools", flat: bool = False) -> list[dict]:
    """OpenAI tool entries as {"type": "function", "function": {name, description, parameters}}
    (`flat`: the Responses API's {"type": "function", "name": ...}); a 400 naming the entry otherwise."""
    out: list[dict] = []
    if len(tools or ()) > MAX_TOOLS:
        raise bad_request(f"{param} has {len(tools or ())} entries; the limit is {MAX_TOOLS}.", param)
    for i, tool in enumerate(tools or ()):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"{where} must be a function tool ({{\"type\": \"function\", ...}}), got "
                              f"{kind!r}; this server runs function tools only.", f"{param}.{i}.type")
        fn = tool if flat else tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where} has no 'function' object; write {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": ..., \"parameters\": {{...}}}}}}.", f"{param}.{i}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad_request(f"{where} needs a 'name' of 1-64 letters, digits, '_', '.' or '-', got {name!r}.",
                              f"{param}.{i}.function.name" if not flat else f"{param}.{i}.name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object.", f"{param}.{i}.parameters")
        desc = fn.get("description")
        entry = {"name": name, "parameters": params, **({"description": desc} if isinstance(desc, str) else {})}
        out.append({"type": "function", "function": entry})
    return out


def tool_choice_of(choice: Any, tools: list[dict], param: str = "tool_choice") -> str:
    """'none', 'auto', 'required' or the named function's name."""
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs at least one entry in tools.", param)
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")   # chat / Responses shapes
    if not isinstance(name, str):
        raise bad_request(f"{param} must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                          f"{{\"name\": ...}}}}.", param)
    if name not in names:
        raise bad_request(f"{param} names the function {name[:64]!r}, which is not in tools "
                          f"({', '.join(names[:8]) or 'none given'}).", param)
    return name


def constraint_for(choice: str, tools: list[dict], parallel: bool = True) -> StructuredOutputs | None:
    """The grammar that makes `required` (a JSON array of calls; one call when not `parallel`) or a
    named function (its arguments) always parse and match the schemas; None for 'none' and 'auto'."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        return StructuredOutputs(json=by_name[choice])
    calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
              "required": ["name", "parameters"]} for n, p in by_name.items()]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
    return StructuredOutputs(json=array)


def constrained_calls(choice: str, text: str) -> list[ToolCall]:
    """The calls of a `required` or named-function output: for `required`, every complete call of
    the array, also when the output was cut short (max_tokens) after some; a named function's call
    only when its arguments are complete."""
    if choice != "required":
        try:
            return [ToolCall(choice, json.dumps(json.loads(text), ensure_ascii=False))]
        except ValueError:
            return []
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in _complete_items(text) if isinstance(c, dict) and isinstance(c.get("name"), str)]


def _complete_items(text: str) -> list[Any]:
    """The complete values of a JSON array, read one by one up to where the text ends or breaks."""
    decoder, items = json.JSONDecoder(), list[Any]()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        return []
    pos += 1
    while True:
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return items
        items.append(item)
        rest = text[pos:].lstrip()
        if not rest.startswith(","):
            return items
        pos = len(text) - len(rest) + 1


# parsing free text (tool_choice auto)
def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(content before the first call, calls) of `<tool_call>{"name", "arguments"}</tool_call>` blocks;
    the last block may be unclosed (the model stopped right after it)."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in text[start:].split(HERMES_OPEN)[1:]:
        body = block.split(HERMES_CLOSE, 1)[0].strip()
        try:
            call = _call_from(json.loads(body), "arguments")
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return text[:start], calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Llama-3 JSON calls: the whole output is `{"name", "parameters"}` objects (optionally after
    <|python_tag|>, several separated by ';')."""
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    calls, pos, dec = [], 0, json.JSONDecoder()
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call_from(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return "", calls


def parse_harmony(text: str) -> tuple[str, list[ToolCall]]:
    """gpt-oss: the final channel's text and the `to=functions.NAME` calls (reasoning dropped)."""
    content, _, calls = harmony_message(text, True)
    return content or "", [ToolCall(name, args) for name, args in calls]


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "harmony": parse_harmony}


def default_parser(tok) -> str:
    """The family's parser: gpt-oss templates (harmony's <|channel|>) use harmony, Llama-3 templates
    (python_tag / ipython) llama3_json, others Hermes."""
    template = str(getattr(tok.tokenizer, "chat_template", "") or "")
    if "<|channel|>" in template:
        return "harmony"
    return "llama3_json" if ("<|python_tag|>" in template or "ipython" in template) else "hermes"


class ToolStream:
    """One choice's output while it streams: content deltas now, tool calls once the output is
    done. `mode` is 'auto' (parse with `parser`) or the constrained tool choice."""

    def __init__(self, mode: str, parser: str):
        self.mode, self.parser = mode, parser
        self.sent = 0                  # characters of content sent

    def _content_end(self, text: str, finished: bool) -> int:
        """How much of `text` is surely content (never part of a call)."""
        if self.mode != "auto":
            return 0
        if self.parser == "llama3_json":
            head = text.lstrip()
            if head.startswith(("{", PYTHON_TAG)) or (not finished and (not head or PYTHON_TAG.startswith(head))):
                return 0
            return len(text)
        start = text.find(HERMES_OPEN)
        if start >= 0:
            return start
        if finished:
            return len(text)
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):    # hold back a partial "<tool_call>"
            if HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def content_delta(self, text: str, finished: bool) -> str:
        end = max(self.sent, self._content_end(text, finished))
        delta, self.sent = text[self.sent:end], end
        return delta

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The final (content, calls) of a finished output."""
        return final_calls(self.mode, self.parser, text)


def final_calls(mode: str, parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content or None, tool calls) of a whole output under tool choice `mode`."""
    if mode == "none":
        return text, []
    if mode == "auto":
        content, calls = PARSERS[parser](text)
        return (content if content.strip() or not calls else None), calls
    calls = constrained_calls(mode, text)
    return (None if calls or mode == "required" else text), calls


# rendering
def tools_prompt(tools: list[dict], parser: str) -> str:
    """What a model whose chat template takes no tools is told about them (in its system message)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser == "llama3_json":
        return ("You have access to these functions. To call one, answer with only a JSON object "
                "{\"name\": function name, \"parameters\": {arguments}}.\n" + listing)
    return ("You may call one or more functions. Function signatures:\n<tools>\n" + listing + "\n</tools>\n"
            "For each call, answer with a JSON object inside tags:\n<tool_call>\n"
            "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def calls_as_text(calls: list[dict], parser: str) -> str:
    """An assistant message's tool calls written the way the parser reads them (for templates that
    do not render `tool_calls`)."""
    parts = []
    for c in calls:
        fn = c.get("function", {})
        args = fn.get("arguments")
        if parser == "llama3_json":
            parts.append(json.dumps({"name": fn.get("name"), "parameters": args}, ensure_ascii=False))
        else:
            parts.append(f"{HERMES_OPEN}\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                                         ensure_ascii=False) + f"\n{HERMES_CLOSE}")
    return ("; " if parser == "llama3_json" else "\n").join(parts)


def prepare_chat(template: str | None, messages: list[dict], tools: list[dict] | None,
                 parser: str) -> tuple[list[dict], dict]:
    """Messages and extra template variables for a conversation with tools: a template that takes
    `tools` gets them; otherwise they are described in the system message and past calls are written
    in the parser's format."""
    template = str(template or "")
    msgs = [dict(m) for m in messages]
    if "tool_calls" not in template:
        for m in msgs:
            if m.get("tool_calls"):
                text = calls_as_text(m.pop("tool_calls"), parser)
                m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
    if tools and "tools" in template:
        return msgs, {"tools": tools}
    if tools:
        note = tools_prompt(tools, parser)
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = f"{msgs[0]['content']}\n\n{note}" if msgs[0]["content"] else note
        else:
            msgs.insert(0, {"role": "system", "content": note})
    return msgs, {}
