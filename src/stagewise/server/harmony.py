"""gpt-oss's chat format (harmony) read back from generated text: the analysis channel becomes
`reasoning_content`, the final (and plain commentary) channel `content`, and messages addressed
`to=functions.NAME` tool calls. `HarmonyStream` re-reads the growing text and sends what each
channel gained, so a stream's deltas add up to the whole body however the tokens were split.
(The openai-harmony package parses token ids of its own o200k vocabulary, which it downloads;
this reads the decoded text, which any tokenizer carrying these special tokens gives.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SPECIAL = re.compile(r"<\|(start|channel|message|end|return|call|constrain)\|>")
STOP_TOKENS = ("<|return|>", "<|call|>")          # the tokens that end an assistant's turn
PARTIAL = re.compile(r"<\|[a-z]*\|?$")            # a special token cut at the text's end
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@dataclass
class Message:
    header: str              # role, channel, recipient and content type, special tokens removed
    body: str
    complete: bool           # the header was closed by <|message|>

    @property
    def channel(self) -> str:
        m = re.search(r"<\|channel\|>\s*(\w+)", self.header)
        return m.group(1) if m else ""

    @property
    def recipient(self) -> str | None:
        m = RECIPIENT.search(self.header)
        return m.group(1) if m else None


@dataclass
class Parsed:
    reasoning: str
    content: str
    calls: list[tuple[str, str]]                    # (name, arguments text)


def messages_of(text: str) -> list[Message]:
    """The assistant messages of an output that starts right after `<|start|>assistant`."""
    out: list[Message] = []
    header, body, in_body, pos = "", "", False, 0
    for m in SPECIAL.finditer(text):
        piece, tok = text[pos:m.start()], m.group(0)
        pos = m.end()
        if in_body:
            body += piece
        else:
            header += piece
        if tok == "<|message|>" and not in_body:
            in_body = True
        elif tok in ("<|end|>", "<|return|>", "<|call|>") and in_body:
            out.append(Message(header, body, True))
            header, body, in_body = "", "", False
        elif tok == "<|start|>":
            if in_body:                              # a message left open: keep what it said
                out.append(Message(header, body, True))
            header, body, in_body = "", "", False
        elif not in_body:
            header += tok                            # <|channel|>, <|constrain|> stay in the header
        else:
            body += tok
    rest = text[pos:]
    if in_body:
        out.append(Message(header, body + rest, True))
    elif header or rest:
        out.append(Message(header + rest, "", False))
    return out


def parse(text: str, finished: bool = True) -> Parsed:
    """Reasoning, content and calls of `text`; before it is finished, a special token cut at the end
    is held back."""
    if not finished:
        text = PARTIAL.sub("", text)
    if not SPECIAL.search(text):
        return Parsed("", text, [])                   # no harmony at all: the text is the answer
    reasoning, content, calls = [], [], []
    for msg in messages_of(text):
        if not msg.complete:
            continue
        name = msg.recipient
        if name is not None:
            calls.append((name, msg.body))
        elif msg.channel == "analysis":
            reasoning.append(msg.body)
        else:
            content.append(msg.body)
    return Parsed("".join(reasoning), "".join(content), calls)


def final_message(text: str, tools_on: bool) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(content, reasoning_content, tool calls as (name, arguments)) of a whole output; calls only
    when tools are on."""
    p = parse(text)
    calls = [(name, args.strip()) for name, args in p.calls] if tools_on else []
    content = p.content if (p.content or not calls) else None
    return content, (p.reasoning or None), calls


class HarmonyStream:
    """One choice's deltas: reasoning_content, content and tool_calls as each grows."""

    def __init__(self, tools_on: bool, call_id: str):
        self.tools_on, self.call_id = tools_on, call_id
        self.reasoning = self.content = 0             # characters sent
        self.args: list[int] = []                     # per call: characters of arguments sent

    def deltas(self, text: str, finished: bool) -> list[dict]:
        p = parse(text, finished)
        out: list[dict] = []
        if len(p.reasoning) > self.reasoning:
            out.append({"reasoning_content": p.reasoning[self.reasoning:]})
            self.reasoning = len(p.reasoning)
        if len(p.content) > self.content:
            out.append({"content": p.content[self.content:]})
            self.content = len(p.content)
        for k, (name, args) in enumerate(p.calls if self.tools_on else []):
            args = args.strip()                       # as the final body has them: a prefix of its text
            if k == len(self.args):
                self.args.append(0)
                out.append({"tool_calls": [{"index": k, "id": f"{self.call_id}_{k}", "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            if len(args) > self.args[k]:
                out.append({"tool_calls": [{"index": k, "function": {"arguments": args[self.args[k]:]}}]})
                self.args[k] = len(args)
        return out

    @property
    def made_calls(self) -> bool:
        return bool(self.args)
