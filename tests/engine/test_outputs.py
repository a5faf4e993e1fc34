"""Incremental detokenization and stop strings: the text equals a full decode, multi-byte
characters never come out half, and the per-step work does not grow with the output."""
import random

import pytest

from stagewise.engine.inputs import Tokenizer
from stagewise.engine.outputs import decode_new_text, finish_check
from stagewise.request import Request, SamplingParams


class CountingTokenizer:
    """The real tokenizer, counting how many token ids every decode call reads."""

    def __init__(self, tok):
        self.tok, self.ids_read = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids_read += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok(llama_dir):
    return Tokenizer(str(llama_dir))


def feed(tok, req, ids):
    reasons = []
    for t in ids:
        req.output_token_ids.append(t)
        reasons.append(finish_check(req, tok, 10**6))
        if reasons[-1]:
            break
    return reasons


def test_incremental_text_equals_full_decode(tok):
    text = "naïve café — 北京 🚀 déjà vu, ünïcödé and plain words " * 3
    ids = tok.encode(text)
    rng = random.Random(0)
    for _ in range(20):
        seq = [rng.choice(ids) for _ in range(60)] + ids[:30]
        req = Request("r", [1], SamplingParams(max_tokens=10**4))
        counting = CountingTokenizer(tok)
        feed(counting, req, seq)
        assert req.text == tok.decode(seq) and "\ufffd" not in req.text[-1:]
        assert counting.ids_read < 12 * len(seq)          # a bounded window per step, not the whole output


def test_stop_strings_cut_and_hold_back(tok):
    ids = tok.encode("the cat sat on the mat and the dog barked")
    req = Request("r", [1], SamplingParams(max_tokens=100, stop=["the dog", "mat and the"]))
    reasons = feed(tok, req, ids)
    assert reasons[-1].value == "stop" and req.text == "the cat sat on the "
    req = Request("r", [1], SamplingParams(max_tokens=100, stop=["sat on the mat!"]))
    seen = []
    for t in ids:
        req.output_token_ids.append(t)
        finish_check(req, tok, 10**6)
        seen.append(req.text)
    assert any(s == "the cat " for s in seen) and "the cat sat on the mat" not in seen   # held back, then released
    assert req.text == tok.decode(ids)


def test_stop_strings_before_min_tokens_are_ignored(tok):
    ids = tok.encode("stop here and stop there")
    req = Request("r", [1], SamplingParams(max_tokens=100, stop=["stop"], min_tokens=3))
    feed(tok, req, ids)
    assert req.text.startswith("stop here and ")


def test_flush_keeps_a_genuine_replacement_character(tok):
    ids = tok.encode("ok \ufffd")
    req = Request("r", [1], SamplingParams(max_tokens=len(ids)))
    reasons = feed(tok, req, ids)
    assert reasons[-1].value == "length" and req.text == "ok \ufffd"
    assert decode_new_text(req, tok, flush=True) == ""
