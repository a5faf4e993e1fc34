"""The completions response shape (`/v1/completions`): choices with `echo`, logprob entries in the
OpenAI completions form and vLLM's `prompt_logprobs`. The n choices of one prompt share its
entries: the engine scores the prompt in its first choice, a stream holds the others back until
those entries arrive, and a whole body serializes them once and sends the body in pieces.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

from ..request import RequestOutput, TokenLogprob
from .bodies import Splicer, body_pieces, dumps, joined_lists, list_items
from .formatting import Shape
from .logprobs import TokenSpans, completion_entries, sorted_top


class CompletionShape(Shape):
    chunk_object = "text_completion"
    keep_stop_token = True        # the generated token comes last: evaluation harnesses drop that entry

    def __init__(self, serving, req, inputs):
        super().__init__(serving, req, "cmpl", req.logprobs is not None)
        self.echo, self.inputs = req.echo, inputs
        self.top_n = req.logprobs or 0
        # NOTE: the engine scores each prompt once, in its first choice; the others show those entries
        self.shares_prompt = self.n > 1 and (self.prompt_logprobs or (self.echo and self.logprobs))
        self.pending: dict[int, RequestOutput] = {}       # streamed choices waiting for their prompt's entries
        self.splicer = Splicer()
        self.shared: tuple[int, str, dict[str, str] | None, str | None] | None = None

    def body(self, inputs, finals: list[RequestOutput]) -> dict:
        return json.loads(b"".join(self.body_pieces(inputs, finals)))

    def body_pieces(self, inputs, finals: list[RequestOutput]) -> Iterator[bytes]:
        head = dict(self.head("text_completion"), choices=[], usage=self.serving.usage(inputs, finals, self.n))
        return body_pieces(head, "choices", (self.choice_json(i, finals) for i in range(len(finals))))

    def choice_json(self, i: int, finals: list[RequestOutput]) -> str:
        f, c = finals[i], finals[i].outputs[0]
        self.prompt_outs.setdefault(self.leader(i), finals[self.leader(i)])
        prompt_text, prompt_items, vllm_lps = self.shared_prompt(i, f)
        raw = {}
        if self.logprobs:
            spans, n = self.shown(f)
            entries = self.entries(f, spans, 0, n, len(prompt_text))
            raw["logprobs"] = joined_lists(prompt_items, entries) if prompt_items else dumps(entries)
        if vllm_lps is not None:
            raw["prompt_logprobs"] = vllm_lps
        choice = {"index": i, "text": prompt_text + c.text, "finish_reason": c.finish_reason, "logprobs": None}
        return self.splicer.dumps(choice, raw)

    def shared_prompt(self, i: int, out: RequestOutput) -> tuple[str, dict[str, str] | None, str | None]:
        """The echoed text, its entries' list items and the vLLM prompt_logprobs JSON of choice i's
        prompt, made once for the prompt's choices (they come one prompt after another)."""
        lead = self.leader(i)
        if self.shared is None or self.shared[0] != lead:
            text, lps = self.prompt(i, out) if self.echo else ("", None)
            items = None if lps is None else {key: list_items(value) for key, value in lps.items()}
            vllm = self.vllm_prompt_logprobs(i, out) if self.prompt_logprobs else None
            self.shared = (lead, text, items, None if vllm is None and not self.prompt_logprobs else dumps(vllm))
        return self.shared[1], self.shared[2], self.shared[3]

    def prompt(self, i: int, out: RequestOutput) -> tuple[str, dict | None]:
        """The echoed prompt: its text as given (token ids: decoded) and, with logprobs, its entries
        (the first token's logprob and top_logprobs null: nothing predicts it)."""
        ids, given = self.inputs[i].prompt_token_ids, self.inputs[i].text
        if not self.logprobs:
            return (given if given is not None else self.tok.decode(ids, self.skip_special)), None
        spans = self.spans().extend(ids)
        text = given if given is not None else spans.flushed_text()
        lps = self.prompt_out(i, out).prompt_logprobs or [None] * len(ids)
        # NOTE: with vLLM's prompt_logprobs too, the engine scored the prompt for the larger top-n
        lps = [lp if lp is None or len(lp.top) <= self.top_n else
               TokenLogprob(lp.token_id, lp.logprob, dict(sorted_top(lp)[:self.top_n]), lp.rank) for lp in lps]
        # NOTE: a text prompt that does not decode back to itself (a normalizing tokenizer) keeps offsets inside it
        return text, completion_entries(self.lp_tok, ids, lps, [min(s, len(text)) for s in spans.starts])

    def entries(self, out: RequestOutput, spans: TokenSpans, begin: int, end: int, base_offset: int) -> dict:
        c = out.outputs[0]
        return completion_entries(self.lp_tok, c.token_ids[begin:end], list(c.logprobs or [])[begin:end],
                                  [base_offset + s for s in spans.starts[begin:end]])

    def render(self, i: int, out: RequestOutput) -> list[dict]:
        """A choice whose prompt's entries have not arrived yet (its first choice scores it) waits;
        the entries' arrival sends the waiting choices' chunks too."""
        lead = self.leader(i)
        if not self.shares_prompt or lead in self.prompt_outs:
            return super().render(i, out)
        if i != lead:
            self.pending[i] = out
            return []
        if not _scored(out):
            return super().render(i, out)
        self.prompt_outs[lead] = out
        chunks = super().render(i, out)
        for j in sorted(k for k in self.pending if self.leader(k) == lead):
            chunks += super().render(j, self.pending.pop(j))
        return chunks

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        st, chunks = self.state(i), []
        if self.echo and not st.started:
            st.started = True
            text, lps = self.prompt(i, out)
            st.prompt_chars = len(text)
            chunks.append(self.chunk({"index": i, "text": text, "logprobs": lps, "finish_reason": None}))
        text = st.advance(out)
        lp, begin, end = None, 0, 0
        if self.logprobs:
            begin, end = st.new_shown(out, self.keep_stop_token)
            lp = self.entries(out, st.spans or self.spans(), begin, end, st.prompt_chars)
        prompt_lps = self.vllm_prompt_logprobs(i, out, stream=True)
        if text or end > begin or out.finished or prompt_lps is not None:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.outputs[0].finish_reason}
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            chunks.append(self.chunk(choice))
        return chunks


def _scored(out: RequestOutput) -> bool:
    """Whether the output carries its whole prompt's entries (the first token's None included)."""
    return out.prompt_logprobs is not None and len(out.prompt_logprobs) >= len(out.prompt_token_ids or ())
