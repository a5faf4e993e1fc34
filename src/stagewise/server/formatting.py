"""Response shapes: cumulative engine outputs as whole bodies and stream deltas, in the OpenAI
completions (with `echo`), OpenAI chat and native /generate forms. Which logprob entries a
response shows, and their shapes, live in `logprobs.py`.
"""
from __future__ import annotations

import logging
import time
import uuid

from ..request import RequestOutput
from .harmony import HarmonyStream, final_message
from .logprobs import (
    TokenIdNames,
    TokenSpans,
    chat_entries,
    native_entries,
    shown_count,
    vllm_prompt_logprobs,
)
from .tools import ToolCall, ToolStream, final_calls

log = logging.getLogger("stagewise.server")


class StreamState:
    """What one choice has sent so far; `advance` returns only the new text."""

    def __init__(self, spans: TokenSpans | None = None):
        self.text = ""
        self.num_tokens = 0
        self.num_shown = 0            # output tokens whose logprob entries were sent
        self.spans = spans
        self.started = False          # chat: the role chunk is sent; completions: the echo is sent
        self.prompt_chars = 0         # completions with echo: text_offset of the output's first character

    def advance(self, out: RequestOutput) -> str:
        c = out.outputs[0]
        # NOTE: a trailing U+FFFD is half a UTF-8 character that the next token completes: hold it back.
        text = c.text if out.finished else c.text.rstrip("\ufffd")
        delta = ""
        if text.startswith(self.text):
            delta, self.text = text[len(self.text):], text
        elif text:
            log.debug("stream text is not an extension of what was sent; dropping the difference")
        self.num_tokens = len(c.token_ids)
        return delta

    def new_shown(self, out: RequestOutput, keep_stop_token: bool) -> tuple[int, int]:
        """The output tokens [begin, end) whose entries this update sends: those starting in the text sent."""
        assert self.spans is not None, "token spans are kept only when logprobs are asked for"
        shown = shown_count(self.spans, out.outputs[0].token_ids, self.text, out.finished, keep_stop_token)
        begin, self.num_shown = self.num_shown, max(self.num_shown, shown)
        return begin, self.num_shown


class Shape:
    """Response shapes for one endpoint: a whole body (`body`), stream chunks (`chunks`), and the
    stream's tail (`tail`)."""

    chunk_object = ""
    keep_stop_token = False           # show the stop token's logprob entry when it adds no text

    def __init__(self, serving, req=None, prefix: str = "cmpl", logprobs: bool = False):
        self.serving, self.tok = serving, serving.tok
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = getattr(req, "n", 1)
        self.include_usage = bool(req is not None and req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries its choice's usage so far
        self.continuous_usage = bool(self.include_usage and req.stream_options.continuous_usage_stats)
        self.logprobs = logprobs
        self.lp_tok = TokenIdNames() if getattr(req, "return_tokens_as_token_ids", None) else serving.tok
        self.prompt_logprobs = getattr(req, "prompt_logprobs", None) is not None
        self.sent_prompt_logprobs: set[int] = set()
        self.prompt_outs: dict[int, RequestOutput] = {}   # a prompt's first choice -> its output with the entries
        self.skip_special = getattr(req, "skip_special_tokens", None) is not False
        self.states: dict[int, StreamState] = {}
        # a LoRA adapter's requests are answered under its name, as vLLM does (None: the served model's)
        model = getattr(req, "model", None)
        self.adapter_name = model if model in getattr(serving, "lora_names", ()) else None

    @property
    def model_name(self) -> str:
        return self.adapter_name or self.serving.model_name

    def head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name}

    def state(self, i: int) -> StreamState:
        if i not in self.states:
            self.states[i] = StreamState(self.spans() if self.logprobs else None)
        return self.states[i]

    def spans(self) -> TokenSpans:
        return TokenSpans(self.tok, self.skip_special)

    def shown(self, out: RequestOutput) -> tuple[TokenSpans, int]:
        """The output's token spans, and how many tokens a whole (non-streamed) body shows entries for."""
        c, spans = out.outputs[0], self.spans()
        return spans, shown_count(spans, c.token_ids, c.text, out.finished, self.keep_stop_token)

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        raise NotImplementedError

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        raise NotImplementedError

    def render(self, i: int, out: RequestOutput) -> list[dict]:
        """`chunks` with vLLM's continuous usage stats (each chunk: its choice's tokens so far)."""
        chunks = self.chunks(i, out)
        if self.continuous_usage:
            prompt = len(out.prompt_token_ids)
            done = len(out.outputs[0].token_ids)
            for chunk in chunks:
                chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        return chunks

    def leader(self, i: int) -> int:
        """The first choice of choice i's prompt (choices come n per prompt): the one that scores it."""
        return i - i % self.n

    def prompt_out(self, i: int, out: RequestOutput) -> RequestOutput:
        """The output that carries choice i's prompt entries: its prompt's first choice's, once known."""
        return self.prompt_outs.get(self.leader(i), out)

    def vllm_prompt_logprobs(self, i: int, out: RequestOutput, stream: bool = False) -> list[dict | None] | None:
        """The request's vLLM `prompt_logprobs` (once per choice in a stream), or None."""
        lps = self.prompt_out(i, out).prompt_logprobs
        if not self.prompt_logprobs or (stream and i in self.sent_prompt_logprobs) or lps is None:
            return None
        self.sent_prompt_logprobs.add(i)
        return vllm_prompt_logprobs(self.lp_tok, lps)

    def tail(self, inputs, finals) -> list[dict]:
        if not self.include_usage:
            return []
        return [dict(self.head(self.chunk_object), choices=[], usage=self.serving.usage(inputs, finals, self.n))]

    def chunk(self, choice: dict) -> dict:
        chunk = dict(self.head(self.chunk_object), choices=[choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk


class ChatShape(Shape):
    chunk_object = "chat.completion.chunk"

    def __init__(self, serving, req, messages: list[dict] | None = None, tool_mode: str = "none"):
        super().__init__(serving, req, "chatcmpl", req.logprobs)
        # vLLM's chat `echo`: the reply starts with the final message's content when it is the assistant's
        last = (messages or [{}])[-1]
        self.echo_text = (last.get("content") or "") if req.echo and last.get("role") == "assistant" else ""
        self.tool_mode, self.parser = tool_mode, serving.tool_call_parser
        self.tool_streams: dict[int, ToolStream] = {}
        # gpt-oss: channels and calls are read from the harmony text (unless a grammar shaped the output)
        self.harmony = self.parser == "harmony" and tool_mode in ("none", "auto")
        self.harmony_streams: dict[int, HarmonyStream] = {}

    def message(self, out: RequestOutput) -> tuple[dict, str | None]:
        """The choice's message (content, tool calls) and finish reason ('tool_calls' when it made calls)."""
        c = out.outputs[0]
        if self.harmony:
            return self.harmony_message(out)
        content, calls = final_calls(self.tool_mode, self.parser, c.text)
        msg: dict = {"role": "assistant", "content": self.echo_text + content if content is not None else content}
        if calls:
            msg["tool_calls"] = [call.as_openai() for call in calls]
        return msg, ("tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason)

    def harmony_message(self, out: RequestOutput) -> tuple[dict, str | None]:
        c = out.outputs[0]
        content, reasoning, calls = final_message(c.text, self.tool_mode == "auto")
        msg: dict = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        if calls:
            msg["tool_calls"] = [ToolCall(name, args).as_openai() for name, args in calls]
        return msg, ("tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason)

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, f in enumerate(finals):
            msg, reason = self.message(f)
            choices.append({"index": i, "message": msg, "finish_reason": reason,
                            "logprobs": self.entries(f, 0, self.shown(f)[1]) if self.logprobs else None})
        body = dict(self.head("chat.completion"), choices=choices, usage=self.serving.usage(inputs, finals, self.n))
        if self.prompt_logprobs and finals:
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(0, finals[0])
        return body

    def entries(self, out: RequestOutput, begin: int, end: int) -> dict:
        return chat_entries(self.lp_tok, list(out.outputs[0].logprobs or [])[begin:end])

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st, chunks = self.state(i), []
        if not st.started:
            st.started = True
            chunks.append(self.chunk({"index": i, "delta": {"role": "assistant", "content": self.echo_text},
                                      "logprobs": None, "finish_reason": None}))
        text = st.advance(out)
        begin, end = st.new_shown(out, self.keep_stop_token) if self.logprobs else (0, 0)
        reason = out.outputs[0].finish_reason
        deltas: list[dict] = [{"content": text}] if text else []
        if self.harmony:
            hs = self.harmony_streams.setdefault(i, HarmonyStream(self.tool_mode == "auto",
                                                                  f"call_{out.request_id[-20:]}"))
            deltas = hs.deltas(st.text, out.finished)
            reason = "tool_calls" if hs.made_calls and reason == "stop" else reason
        elif self.tool_mode != "none":
            deltas, reason = self.tool_deltas(i, st.text, text, out)
        lp = self.entries(out, begin, end) if self.logprobs else None
        if not deltas and (end > begin or out.finished):
            deltas = [{}]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            chunks.append(self.chunk({"index": i, "delta": delta, "logprobs": lp if last else None,
                                      "finish_reason": reason if last and out.finished else None}))
        return chunks

    def tool_deltas(self, i: int, text: str, new: str, out: RequestOutput) -> tuple[list[dict], str | None]:
        """Deltas under a tool choice: content as it streams; a named function's arguments as they
        stream; otherwise each call once the output is done (name first, then its arguments)."""
        ts = self.tool_streams.setdefault(i, ToolStream(self.tool_mode, self.parser))
        reason = out.outputs[0].finish_reason
        if self.tool_mode not in ("auto", "required"):          # a named function: the text is its arguments
            if not new:
                return [], ("tool_calls" if reason == "stop" else reason)
            call = {"index": 0, "function": {"arguments": new}}
            if ts.sent == 0:
                call.update(id=f"call_{out.request_id[-24:]}", type="function",
                            function={"name": self.tool_mode, "arguments": new})
            ts.sent += len(new)
            return [{"tool_calls": [call]}], ("tool_calls" if reason == "stop" else reason)
        content = ts.content_delta(text, out.finished)
        deltas: list[dict] = [{"content": content}] if content else []
        if out.finished:
            _, calls = ts.calls(text)
            for k, tc in enumerate(calls):
                deltas.append({"tool_calls": [{"index": k, "id": tc.id, "type": "function",
                                               "function": {"name": tc.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": tc.arguments}}]})
            if calls and reason == "stop":
                reason = "tool_calls"
        return deltas, reason


class NativeShape(Shape):
    """Raw engine results: every generated token (a stop token too) with its logprob entry."""
    chunk_object = "generate.chunk"

    def __init__(self, serving):
        super().__init__(serving, None, "gen")

    def state(self, i: int) -> StreamState:
        return self.states.setdefault(i, StreamState())

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        out = finals[0]
        c = out.outputs[0]
        return {"id": self.id, "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                "logprobs": native_entries(c.logprobs), "prompt_logprobs": native_entries(out.prompt_logprobs),
                "num_cached_tokens": out.num_cached_tokens, "usage": self.serving.usage(inputs, finals, 1)}

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st = self.state(i)
        ids_before = st.num_tokens
        text = st.advance(out)
        ids = out.outputs[0].token_ids[ids_before:st.num_tokens]
        if not text and not ids and not out.finished:
            return []
        lps = list(out.outputs[0].logprobs or [])[ids_before:st.num_tokens]
        return [{"id": self.id, "text": text, "token_ids": list(ids), "finish_reason": out.outputs[0].finish_reason,
                 "logprobs": native_entries(lps)}]

    def tail(self, inputs, finals) -> list[dict]:
        # the prompt's entries once, at the end (the first output already has them all)
        return [{"id": self.id, "prompt_logprobs": native_entries(finals[0].prompt_logprobs),
                 "usage": self.serving.usage(inputs, finals, 1)}]
