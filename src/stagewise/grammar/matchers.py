"""Structured outputs on the driver: one matcher per constrained request, the packed token bitmask
of each plan's constrained sampling rows, and the sampled tokens accepted back. Grammars come
compiled from the compile service (grammar/service.py); nothing here compiles or parses.

A request has at most one sampling row in flight, so when the scheduler books it the driver has
accepted every token it sampled: the matcher's state is exact, under PP, micro-batches, chunked
prefill, prefix hits and preemption alike (re-prefill recomputes KV, not outputs). The bitmask
travels with the plan; the sampling stage applies it (runtime/sampler.py). Any matcher fault, and
a grammar whose constraints leave no token, fails its own request alone (a 4xx status).
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

from ..plan import StepPlan, TokenBitmask
from ..request import Request
from ..runtime.sampler import NO_ALLOWED_TOKEN, NO_TOKEN_LEFT
from .compile_child import first_line
from .limits import GrammarLimits, GrammarRefused
from .service import CompileService, Ticket

log = logging.getLogger("stagewise.engine")
BAD_REQUEST = 400           # the error status of a request failed by its own grammar


class Matcher(Protocol):
    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> Any: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


def _as_transformers(tokenizer):
    """xgrammar reads a transformers fast tokenizer (and imports transformers itself): a GGUF model's
    `SavedTokenizer` goes to it as one over a copy of the same backend and special tokens."""
    from ..checkpoint.saved_tokenizer import SavedTokenizer
    if not isinstance(tokenizer, SavedTokenizer):
        return tokenizer
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, **tokenizer.special_tokens_map)


class XGrammarBackend:
    """xgrammar's tokenizer info for this model (built once: seconds for a large vocabulary), the
    tokens JSON may hold, matchers and bitmasks."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(_as_transformers(hf_tokenizer), vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self.json_tokens = self._packed(self._json_keep())
        import torch
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[list(self.info.stop_token_ids)] = False
        self.non_stop = self._packed(keep)             # every token but the stop tokens

    def _json_keep(self) -> Any:
        """bool `[V]`: the tokens a JSON output may hold. NOTE: xgrammar's JSON string rule lets raw
        control characters (U+0000-U+001F) through, which JSON forbids and strict parsers (pydantic,
        json.loads) reject; compact JSON needs none outside strings either."""
        import torch
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        for i, piece in enumerate(self.info.decoded_vocab[:self.vocab_size]):
            if any(b < 0x20 for b in piece):
                keep[i] = False
        keep[list(self.info.stop_token_ids)] = True
        return keep

    def _packed(self, keep: Any) -> Any:
        """bool `[V]` as int32 `[ceil(V/32)]` words, xgrammar's bitmask layout."""
        import torch
        bits = torch.zeros(-(-self.vocab_size // 32) * 32, dtype=torch.int64)
        bits[:self.vocab_size] = keep.to(torch.int64)
        words = (bits.view(-1, 32) << torch.arange(32)).sum(-1)                  # little-endian bit order
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def deserialize(self, data: str) -> Any:
        return self.xgr.CompiledGrammar.deserialize_json(data, self.info)

    def matcher(self, compiled: Any) -> Matcher:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)   # int32 [rows, ceil(V/32)]


class StructuredOutputManager:
    """Sends each constrained request's grammar to the compile service, makes its matcher once the
    grammar is ready, fills plan bitmasks and accepts sampled tokens."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], limits: GrammarLimits):
        self.service = CompileService(lambda: XGrammarBackend(hf_tokenizer, vocab_size, stop_token_ids), limits)
        self.pending: dict[str, tuple[Request, Ticket]] = {}     # compiling (waiting in the scheduler)
        self.matchers: dict[str, Matcher] = {}
        self.requests: dict[str, Request] = {}                  # the constrained requests with a matcher
        self.failures: dict[str, str] = {}                       # matchers that failed in `fill`
        self.json_rows: set[str] = set()                         # JSON grammars: no control characters

    @property
    def backend(self) -> XGrammarBackend:
        return self.service.backend

    def submit(self, req: Request) -> None:
        spec = req.params.grammar
        assert spec is not None
        self.pending[req.request_id] = (req, self.service.submit(req.params.cache_salt or "", *spec.key))

    def admits(self, req: Request) -> bool:
        """The scheduler's admission rule: a constrained request starts once its matcher is made."""
        return req.params.grammar is None or req.request_id in self.matchers

    def take_failed(self) -> list[tuple[Request, str]]:
        """Make the matchers of the grammars that are ready; returns (request, why) for each whose
        compile failed, carrying its status (`error_status`)."""
        failed = []
        for rid, (req, ticket) in list(self.pending.items()):
            if not ticket.future.done():
                continue
            del self.pending[rid]
            try:
                self.matchers[rid] = self.backend.matcher(ticket.future.result())
            except GrammarRefused as exc:
                req.error_status = exc.status if exc.status != 500 else None     # 503: retry
                failed.append((req, str(exc)))
                continue
            except Exception as exc:        # noqa: BLE001  (a matcher that cannot be made fails its request)
                req.error_status = BAD_REQUEST
                failed.append((req, f"The request's grammar could not be used: {first_line(exc)}"))
                continue
            self.requests[rid] = req
            spec = req.params.grammar
            if spec is not None and spec.kind in ("json", "json_object"):
                self.json_rows.add(rid)
        return failed

    def wait(self, timeout_s: float) -> None:
        """Block until some pending compile finishes (or `timeout_s`): an offline loop with nothing
        else to do waits here instead of spinning."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures
        if self.pending:
            wait_futures([t.future for _, t in self.pending.values()], timeout_s, FIRST_COMPLETED)

    def drop_pending(self, request_id: str) -> None:
        """A compiling request ended (aborted): its compile is cancelled unless others wait for it."""
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            self.service.cancel(entry[1])

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
                self.failures[rid] = f"The request's grammar failed while generating: {first_line(exc)}"
                continue
            if rid in self.json_rows:
                bits[i] &= self.backend.json_tokens
            if self._ends_too_soon(rid, bits[i]):
                continue
            ok.append(i)
        if not ok:
            return None
        return TokenBitmask([rids[i] for i in ok], bits if len(ok) == len(rids) else bits[ok])

    def _ends_too_soon(self, rid: str, row: Any) -> bool:
        """A grammar that allows only a stop token while min_tokens bans it: the request fails (400)."""
        req = self.requests[rid]
        p = req.params
        if p.ignore_eos or len(req.output_token_ids) >= p.min_tokens or bool((row & self.backend.non_stop).any()):
            return False
        self.failures[rid] = (f"The request's grammar is complete after {len(req.output_token_ids)} tokens, before "
                              f"min_tokens ({p.min_tokens}); lower min_tokens.")
        return True

    def settle(self, plan: StepPlan, result) -> None:
        """Advance the matchers of the plan's constrained rows by their sampled tokens; a matcher
        that refuses or fails (or failed in `fill`) fails its own request, with a 4xx status, and
        so does a row whose constraints left the sampler no token."""
        failed = {s.request_id: self.failures.pop(s.request_id) for s in plan.seqs if s.request_id in self.failures}
        for rid in plan.token_bitmask.request_ids if plan.token_bitmask is not None else ():
            token = result.sampled.get(rid)
            if result.failed.get(rid) in (NO_ALLOWED_TOKEN, NO_TOKEN_LEFT):
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
            log.warning("request %s: the grammar matcher failed: %s", request_id, first_line(exc))
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
        self.drop_pending(request_id)

    def stats(self) -> dict:
        return self.service.stats()

    def shutdown(self) -> None:
        self.service.shutdown()
