"""Grammar compilation off the step loop (grammar/): limits refuse oversized constraints
with the flag that raises them; the compile service compiles once per (tenant, constraint), keeps
a bounded cache, and a compile over its time or memory budget, or one whose requests all left,
ends alone (killed) while the next one compiles."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from stagewise.grammar.limits import GrammarLimits, GrammarRefused, check_limits
from stagewise.grammar.matchers import XGrammarBackend
from stagewise.grammar.service import CompileService, GrammarCache

pytestmark = pytest.mark.slow          # a supervisor process per service
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
SLOW_REGEX = "a*" * 1000               # ~35 s of CPU to compile, whatever the vocabulary
WAIT_S = 120.0                         # a supervisor starts in seconds; a loaded CI box is slower


def _deep_schema(levels: int) -> str:
    text = "{}"
    for _ in range(levels):
        text = '{"type": "array", "items": %s}' % text
    return text


@pytest.mark.parametrize("kind, text, flag", [
    ("json", json.dumps({"enum": ["x" * 100] * 700}), "--grammar-max-bytes"),
    ("regex", "a*" * 40_000, "--grammar-max-bytes"),
    ("json", _deep_schema(800), "--grammar-max-depth"),
    ("json", _deep_schema(70), "--grammar-max-depth"),
    ("regex", "(" * 70 + "a" + ")" * 70, "--grammar-max-depth"),
    ("grammar", 'root ::= ' + " | ".join(f'"w{i}"' for i in range(2000)), "--grammar-max-alternatives"),
    ("choice", json.dumps([f"c{i}" for i in range(2000)]), "--grammar-max-alternatives"),
    ("json", json.dumps({"anyOf": [{"const": i} for i in range(1100)]}), "--grammar-max-alternatives"),
], ids=["schema-bytes", "regex-bytes", "schema-800-deep", "schema-70-deep", "regex-deep", "grammar-alternatives",
        "choices", "anyof"])
def test_limits_refuse_with_the_flag_that_raises_them(kind, text, flag):
    with pytest.raises(GrammarRefused, match=flag) as info:
        check_limits(kind, text, GrammarLimits())
    assert info.value.status == 400


@pytest.mark.parametrize("schema", [{"type": "string", "minLength": -1}, {"type": "array", "minItems": -1},
                                    {"properties": {"a": {"type": "array", "maxItems": 1.5}}}])
def test_negative_or_fractional_counts_are_refused(schema):
    with pytest.raises(GrammarRefused, match="must be a non-negative integer"):
        check_limits("json", json.dumps(schema), GrammarLimits())
    check_limits("json", json.dumps({"const": {"minLength": -1}, "properties": {"minItems": {}}}), GrammarLimits())


def test_limits_skip_literals_classes_and_escapes():
    check_limits("grammar", 'root ::= "((((|||" [(|] "\\"" ("a" | "b")', GrammarLimits(max_depth=1, max_alternatives=2))
    check_limits("regex", r"[(|]+\(\|" + "(a|b)", GrammarLimits(max_depth=1, max_alternatives=2))
    with pytest.raises(GrammarRefused, match="not valid JSON"):
        check_limits("json", "{bad", GrammarLimits())


def test_the_cache_is_bounded_in_entries_and_bytes_least_recently_used_out():
    cache = GrammarCache(max_entries=2, max_bytes=100)
    cache.put(("t", "regex", "a"), "A", 10)
    cache.put(("t", "regex", "b"), "B", 10)
    assert cache.get(("t", "regex", "a")) == "A"          # a is now the most recent
    cache.put(("t", "regex", "c"), "C", 10)
    assert cache.get(("t", "regex", "b")) is None and cache.get(("t", "regex", "a")) == "A"
    cache.put(("t", "regex", "d"), "D", 95)
    assert list(cache.entries) == [("t", "regex", "d")] and cache.num_bytes == 95


@pytest.fixture(scope="module")
def backend(llama_dir):
    from stagewise.engine.inputs import Tokenizer
    tok = Tokenizer(str(llama_dir), None)
    return XGrammarBackend(tok.tokenizer, tok.vocab_size, tok.eos_token_ids)


@pytest.fixture(scope="module")
def service(backend):
    svc = CompileService(lambda: backend, GrammarLimits(compile_timeout_s=2.0, workers=1, memory=512 << 20,
                                                         cache_entries=4))
    yield svc
    svc.shutdown()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_one_compile_per_tenant_and_constraint(service):
    a1, a2 = service.submit("tenant-a", "json", SCHEMA), service.submit("tenant-a", "json", SCHEMA)
    b = service.submit("tenant-b", "json", SCHEMA)
    assert a1.future is a2.future and b.future is not a1.future      # tenants share nothing
    compiled = a1.future.result(WAIT_S)
    assert b.future.result(WAIT_S) is not compiled
    again = service.submit("tenant-a", "json", SCHEMA)
    assert again.job is None and again.future.result(0) is compiled   # answered from the cache


def test_a_compile_over_its_time_budget_is_408_and_the_next_one_compiles(service):
    slow = service.submit("t", "regex", SLOW_REGEX)
    quick = service.submit("t", "regex", "[0-9]+")
    with pytest.raises(GrammarRefused, match="--grammar-compile-timeout-s") as info:
        slow.future.result(WAIT_S)
    assert info.value.status == 408
    assert quick.future.result(WAIT_S) is not None


def test_a_bad_grammar_fails_alone_with_the_compiler_s_sentence(service):
    bad = service.submit("t", "grammar", "root ::= foo")
    with pytest.raises(GrammarRefused, match="not defined") as info:
        bad.future.result(WAIT_S)
    assert info.value.status == 400
    empty = service.submit("t", "grammar", "root ::= [^\\x00-\\U0010FFFF]")      # an empty language
    with pytest.raises(GrammarRefused, match="allows no token"):
        empty.future.result(WAIT_S)


def test_a_compile_nobody_waits_for_is_killed(service):
    service.submit("t", "regex", "x").future.result(WAIT_S)            # the supervisor is up
    slow = service.submit("t", "regex", SLOW_REGEX + "b")
    pid = service.supervisor_pid
    deadline = time.monotonic() + WAIT_S
    while not _children(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children(pid), "the compile never started"
    service.cancel(slow)
    assert slow.future.cancelled()
    while _children(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _children(pid)
    t0 = time.monotonic()
    assert service.submit("t", "regex", "y+").future.result(WAIT_S) is not None
    assert time.monotonic() - t0 < 30.0             # the one worker was free again (the slow one takes minutes)


def test_a_compile_over_its_memory_budget_fails_alone(backend):
    svc = CompileService(lambda: backend, GrammarLimits(max_bytes=1 << 20, workers=1, memory=64 << 20,
                                                        compile_timeout_s=60.0))
    try:
        huge = svc.submit("t", "regex", "a*" * 50_000)
        with pytest.raises(GrammarRefused, match="memory") as info:
            huge.future.result(WAIT_S)
        assert info.value.status == 400
        assert svc.submit("t", "json", SCHEMA).future.result(WAIT_S) is not None
    finally:
        svc.shutdown()


def test_slow_compiles_do_not_hold_up_a_small_fresh_one(service):
    """Issue 42: four slow regexes in flight (one worker) held a trivial schema for all their budgets;
    the quick lane compiles it at once, and a slow one it tried still gets a worker's verdict."""
    service.submit("t", "regex", "x").future.result(WAIT_S)            # the supervisor is up
    slow = [service.submit(f"u{i}", "regex", SLOW_REGEX) for i in range(4)]
    time.sleep(0.5)
    t0 = time.monotonic()
    fresh = service.submit("other", "json", json.dumps({"type": "object", "properties": {"f": {"type": "boolean"}}}))
    assert fresh.future.result(WAIT_S) is not None
    waited = time.monotonic() - t0
    for ticket in slow[:1] + slow[2:]:
        service.cancel(ticket)
    with pytest.raises(GrammarRefused, match="--grammar-compile-timeout-s") as info:
        slow[1].future.result(WAIT_S)                  # it ran in the quick lane first, then on the worker
    assert info.value.status == 408
    assert waited < 4.0, f"the fresh schema waited {waited:.1f} s behind slow compiles"


@pytest.mark.parametrize("schema, violation", [
    ({"type": "integer", "not": {"const": 3}}, "3"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "number", "multipleOf": 0.5}, "1.3"),
], ids=["not", "uniqueItems", "allOf", "dependentRequired", "multipleOf"])
def test_keywords_xgrammar_ignores_are_refused(schema, violation):
    """Why the limit check refuses them: xgrammar compiles them and accepts output that breaks them."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), violation)
    with pytest.raises(GrammarRefused, match="does not enforce"):
        check_limits("json", json.dumps(schema), GrammarLimits())
