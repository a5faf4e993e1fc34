"""Structured outputs on the driver: grammars compiled off the step loop, one matcher per request,
and the packed token bitmask of each plan's constrained sampling rows.

A request has at most one sampling row in flight, so when the scheduler books it the driver has
accepted every token it sampled: the matcher's state is exact, under PP, micro-batches, chunked
prefill, prefix hits and preemption alike (re-prefill recomputes KV, not outputs). The bitmask
travels with the plan; the sampling stage applies it (runtime/sampler.py). The backend (xgrammar)
sits behind `GrammarBackend` so another could be added.
"""
from __future__ import annotations

import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from ..plan import StepPlan, TokenBitmask
from ..request import Request, StructuredOutputs
from ..runtime.sampler import NO_ALLOWED_TOKEN

log = logging.getLogger("stagewise.engine")
COMPILE_THREADS = 2
MAX_SCHEMA_CHARS = 200_000
BAD_REQUEST = 400           # the error status of a request failed by its own grammar


class Matcher(Protocol):
    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> Any: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


def _schema_text(spec: StructuredOutputs) -> str:
    text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"structured_outputs.json is {len(text)} characters; the limit is {MAX_SCHEMA_CHARS}.")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON ({exc}); give a JSON schema.") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema object.")
    return text


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarBackend:
    """xgrammar: JSON Schema, any JSON object, regex, choice (as EBNF) and EBNF grammars."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=True)
        self.vocab_size = vocab_size
        self.info = info
        self._json_tokens: Any = None

    def json_tokens(self) -> Any:
        """int32 `[ceil(V/32)]`: the tokens a JSON output may hold. NOTE: xgrammar's JSON string rule
        lets raw control characters (U+0000-U+001F) through, which JSON forbids and strict parsers
        (pydantic, json.loads) reject; compact JSON needs none outside strings either."""
        if self._json_tokens is None:
            import torch
            keep = torch.ones(self.vocab_size, dtype=torch.bool)
            for i, piece in enumerate(self.info.decoded_vocab[:self.vocab_size]):
                if any(b < 0x20 for b in piece):
                    keep[i] = False
            keep[list(self.info.stop_token_ids)] = True
            bits = torch.zeros(-(-self.vocab_size // 32) * 32, dtype=torch.int64)
            bits[:self.vocab_size] = keep.to(torch.int64)
            words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)                  # little-endian bit order
            self._json_tokens = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return self._json_tokens

    @staticmethod
    def check(spec: StructuredOutputs) -> None:
        """Parse `spec` without a tokenizer (cheap): ValueError naming what is wrong."""
        import xgrammar as xgr
        kind = spec.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(_schema_text(spec))
            elif kind == "regex":
                xgr.Grammar.from_regex(str(spec.regex))
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(str(spec.grammar))
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice or ()))
        except ValueError:
            raise
        except Exception as exc:     # noqa: BLE001  (xgrammar raises RuntimeError and its own types)
            raise ValueError(f"structured_outputs.{kind} was rejected by the grammar compiler: "
                             f"{_first_line(exc)}") from None

    def compile(self, spec: StructuredOutputs) -> Any:
        kind, c = spec.kind, self.compiler
        # NOTE: compact JSON (no free whitespace): small models otherwise loop on newlines and indents
        if kind == "json":
            return c.compile_json_schema(_schema_text(spec), any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(str(spec.regex))
        if kind == "choice":
            return c.compile_grammar(_choice_ebnf(spec.choice or ()))
        return c.compile_grammar(str(spec.grammar))

    def matcher(self, compiled: Any) -> Matcher:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)   # int32 [rows, ceil(V/32)]


class GrammarBackend(Protocol):
    def compile(self, spec: StructuredOutputs) -> Any: ...
    def matcher(self, compiled: Any) -> Matcher: ...
    def allocate(self, rows: int) -> Any: ...
    def json_tokens(self) -> Any: ...


_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")     # "[14:29:10] /project/cpp/x.cc:94: "


def _first_line(exc: BaseException) -> str:
    """The message of a backend error, without its C++ source location."""
    lines = [t.strip() for t in str(exc).splitlines() if t.strip()]
    line = _SOURCE_PREFIX.sub("", next((t for t in lines if _SOURCE_PREFIX.match(t)), lines[0] if lines else
                                       type(exc).__name__))
    return line[:300].rstrip(".") + "."


def check_structured(params) -> None:
    """The 400-time check of a request's grammar (no tokenizer needed): ValueError on a bad one."""
    spec = params.grammar
    if spec is not None:
        XGrammarBackend.check(spec)


class StructuredOutputManager:
    """Compiles grammars on a thread pool (futures cached by spec, so n > 1 and repeated schemas
    compile once), owns each constrained request's matcher, fills plan bitmasks and accepts
    sampled tokens."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="stagewise-grammar")
        self.compiled: dict[tuple[str, str], Future] = {}
        self.pending: dict[str, tuple[Request, Future]] = {}     # compiling, not yet scheduled
        self.matchers: dict[str, Matcher] = {}
        self.requests: dict[str, Request] = {}                  # the constrained requests with a matcher
        self.failures: dict[str, str] = {}                       # matchers that failed in `fill`
        self.json_rows: set[str] = set()                         # JSON grammars: no control characters

    def submit(self, req: Request) -> None:
        spec = req.params.grammar
        assert spec is not None
        fut = self.compiled.get(spec.key)
        if fut is None:
            fut = self.compiled[spec.key] = self.pool.submit(self.backend.compile, spec)
        self.pending[req.request_id] = (req, fut)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (matcher made), and (request, why) whose compile failed."""
        ready, failed = [], []
        for rid, (req, fut) in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[rid]
            exc = fut.exception()
            if exc is not None:
                spec = req.params.grammar
                self.compiled.pop(spec.key, None) if spec is not None else None
                req.error_status = BAD_REQUEST
                failed.append((req, f"The grammar of this request failed to compile: {_first_line(exc)}"))
                continue
            self.matchers[rid] = self.backend.matcher(fut.result())
            self.requests[rid] = req
            spec = req.params.grammar
            if spec is not None and spec.kind in ("json", "json_object"):
                self.json_rows.add(rid)
            ready.append(req)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some pending compile finishes (or `timeout_s`): an offline loop with nothing
        else to do waits here instead of spinning."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures
        if self.pending:
            wait_futures([f for _, f in self.pending.values()], timeout_s, FIRST_COMPLETED)

    def drop_pending(self, request_id: str) -> Request | None:
        entry = self.pending.pop(request_id, None)
        return entry[0] if entry else None

    def fill(self, plan: StepPlan) -> TokenBitmask | None:
        """The bitmask of the plan's constrained sampling rows; None (no cost) when there are none.
        A matcher that fails here fails its own request when the plan returns (`settle`); its row
        goes unconstrained meanwhile (the token is dropped with the request)."""
        rids = [s.request_id for s in plan.seqs if s.sample and s.request_id in self.matchers]
        if not rids:
            return None
        bits = self.backend.allocate(len(rids))
        ok = []
        for i, rid in enumerate(rids):
            try:
                m = self.matchers[rid]
                if m.is_terminated():       # finished by the stop rule the step it terminated; never here
                    raise RuntimeError("the grammar is already complete")
                m.fill_next_token_bitmask(bits, i)
            except Exception as exc:        # noqa: BLE001  (a matcher fault is its request's alone)
                self.failures[rid] = f"The request's grammar failed while generating: {_first_line(exc)}"
                continue
            if rid in self.json_rows:
                bits[i] &= self.backend.json_tokens()
            ok.append(i)
        if not ok:
            return None
        return TokenBitmask([rids[i] for i in ok], bits if len(ok) == len(rids) else bits[ok])

    def settle(self, plan: StepPlan, result) -> None:
        """Advance the matchers of the plan's constrained rows by their sampled tokens; a matcher
        that refuses or fails (or failed in `fill`) fails its own request, with a 4xx status, and
        so does a row whose constraints left the sampler no token."""
        failed = {s.request_id: self.failures.pop(s.request_id) for s in plan.seqs if s.request_id in self.failures}
        for rid in plan.token_bitmask.request_ids if plan.token_bitmask is not None else ():
            token = result.sampled.get(rid)
            if result.failed.get(rid) == NO_ALLOWED_TOKEN:
                failed[rid] = ("The request's constraints allow no token here (its grammar together with "
                               "allowed_token_ids, bad_words or min_tokens); loosen them.")
            elif token is not None and not self._accept(rid, token):
                failed[rid] = f"the sampled token {token} is outside the request's grammar"
        for rid, why in failed.items():
            result.failed[rid] = why
            if (req := self.requests.get(rid)) is not None:
                req.error_status = BAD_REQUEST

    def _accept(self, request_id: str, token: int) -> bool:
        m = self.matchers.get(request_id)
        try:
            return m is None or bool(m.accept_token(token))
        except Exception as exc:            # noqa: BLE001  (a matcher fault is its request's alone)
            log.warning("request %s: the grammar matcher failed: %s", request_id, _first_line(exc))
            return False

    def is_terminated(self, request_id: str) -> bool:
        """The request's grammar is complete (it accepted a stop token): its output ends here."""
        m = self.matchers.get(request_id)
        try:
            return m is not None and bool(m.is_terminated())
        except Exception:                   # noqa: BLE001
            return False

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.requests.pop(request_id, None)
        self.failures.pop(request_id, None)
        self.json_rows.discard(request_id)
        self.pending.pop(request_id, None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
