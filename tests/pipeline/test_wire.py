"""Driver <-> stage messages without pickle (executor/messages.py, cluster/codec.py, transport.py):
every StepPlan / StepResult the engine can build comes back exactly as it went (nested dataclasses,
sampling parameters and their derived bad-word ids, token bitmasks and prompt embeddings as tensors,
speculative drafts, logprobs with -inf), through the codec and through a real link; an unknown or
malformed message is refused with a sentence naming what is wrong, before a tensor is allocated."""
from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagewise.cluster.codec import WireError
from stagewise.cluster.transport import MAGIC, PREFIX, Link, LinkError
from stagewise.executor.messages import (
    CODEC,
    CONTROL,
    RING,
    Heartbeat,
    PlanFailedMsg,
    PlanMsg,
    ReadyMsg,
    ResultMsg,
    Shutdown,
    StageAlive,
    recv_message,
    send_message,
)
from stagewise.graph.policy import GraphVerdict
from stagewise.plan import CachedRequestData, NewRequestData, ScheduledSeq, StepPlan, StepResult, TokenBitmask
from stagewise.planning.memory import MemoryPlan
from stagewise.request import SamplingParams, StructuredOutputs, TokenLogprob

SRC = Path(__file__).resolve().parents[2] / "src" / "stagewise"
ids = st.lists(st.integers(0, 2**31), max_size=12)
rid = st.text(min_size=1, max_size=8)
floats = st.floats(allow_nan=False, width=64)


def state(x):
    """Everything an object holds, types included (a tuple is not a list, 1 is not 1.0): dataclasses by
    their attributes (fields and any others), tensors by dtype, shape and bytes."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape), x.contiguous().view(torch.uint8).reshape(-1).tolist()
                if x.numel() else [])
    if hasattr(x, "__dataclass_fields__"):
        return (type(x).__name__, state(vars(x)))
    if isinstance(x, dict):
        return ("dict", [(state(k), state(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [state(v) for v in x])
    return (type(x).__name__, x)


def roundtrip(msg, allowed=RING):
    wire, tensors = CODEC.encode(msg)
    return CODEC.decode(json.loads(json.dumps(wire)), tensors, allowed)


@st.composite
def structured(draw):
    kind = draw(st.sampled_from(["json", "json_text", "regex", "choice", "grammar", "json_object"]))
    if kind == "json":
        return StructuredOutputs(json=draw(st.dictionaries(st.text(max_size=5), st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3)), max_size=3)))
    if kind == "json_text":
        return StructuredOutputs(json='{"type": "object"}')
    if kind == "choice":
        return StructuredOutputs(choice=draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=4)))
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    return StructuredOutputs(**{kind: draw(st.text(min_size=1, max_size=10))})


@st.composite
def sampling(draw):
    max_tokens = draw(st.integers(1, 500))
    kwargs = dict(
        max_tokens=max_tokens, temperature=draw(st.sampled_from([0.0, 1.0, 0.7, 1e-6, 2.5])),
        top_p=draw(st.floats(0.01, 1.0)), top_k=draw(st.integers(-1, 50)), min_p=draw(st.floats(0, 1)),
        repetition_penalty=draw(st.floats(0.01, 100)), presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)), seed=draw(st.none() | st.integers(-2**63, 2**63)),
        stop=draw(st.none() | st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5),
                                                                         max_size=3)),
        stop_token_ids=draw(st.none() | st.lists(st.integers(0, 2**62), max_size=3)),
        ignore_eos=draw(st.booleans()), logprobs=draw(st.none() | st.integers(0, 20)),
        prompt_logprobs=draw(st.none() | st.integers(0, 20)), min_tokens=draw(st.integers(0, max_tokens)),
        skip_special_tokens=draw(st.booleans()),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, 5000), st.floats(-100, 100), max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(st.integers(0, 5000), min_size=1, max_size=4)),
        bad_words=draw(st.none() | st.lists(st.text("abc ", min_size=1, max_size=4).filter(str.strip),
                                            max_size=2)),
        include_stop_str_in_output=draw(st.booleans()),
        truncate_prompt_tokens=draw(st.none() | st.just(-1) | st.integers(1, 99)),
        cache_salt=draw(st.none() | st.text(min_size=1, max_size=4)),
        structured_outputs=draw(st.none() | structured()))
    choices = getattr(kwargs["structured_outputs"], "choice", None)
    if choices and not kwargs["ignore_eos"]:    # a choice ends the output: min_tokens must fit the longest
        kwargs["min_tokens"] = min(kwargs["min_tokens"], max(len(c.encode("utf-8", "replace")) for c in choices))
    params = SamplingParams(**kwargs)
    if params.bad_words:        # derived by the engine on the driver; must reach the sampling stage
        params.bad_words_token_ids = draw(st.lists(ids.filter(bool), min_size=1, max_size=2))
    return params


def tensors(dtype, rows, cols):
    values = st.lists(st.floats(-1e3, 1e3, width=32), min_size=rows * cols, max_size=rows * cols)
    return values.map(lambda v: torch.tensor(v, dtype=torch.float32).reshape(rows, cols).to(dtype))


@st.composite
def plans(draw):
    seqs = draw(st.lists(st.builds(ScheduledSeq, rid, st.integers(0, 9999), st.integers(1, 64), st.booleans(), ids),
                         max_size=5))
    new = draw(st.lists(st.builds(
        NewRequestData, rid, ids, st.integers(0, 99), sampling(), ids,
        st.none() | st.integers(0, 3).flatmap(lambda n: tensors(draw(st.sampled_from(
            [torch.float32, torch.bfloat16, torch.float16])), n, 4))), max_size=3))
    mask = draw(st.none() | st.integers(1, 3).flatmap(lambda k: st.builds(
        TokenBitmask, st.lists(rid, min_size=k, max_size=k),
        st.lists(st.integers(-2**31, 2**31 - 1), min_size=2 * k, max_size=2 * k).map(
            lambda v: torch.tensor(v, dtype=torch.int32).reshape(-1, 2)))))
    return StepPlan(
        draw(st.integers(0, 2**40)), seqs, new,
        draw(st.lists(st.builds(CachedRequestData, rid, ids, ids, st.none() | st.integers(0, 99)), max_size=4)),
        draw(st.lists(rid, max_size=3)), draw(ids),
        draw(st.none() | st.builds(GraphVerdict, st.sampled_from(["prefill", "decode"]),
                                   st.none() | st.integers(1, 512), st.none() | st.text(max_size=8))),
        draw(st.lists(st.floats(0, 100), max_size=3)), draw(st.lists(st.floats(0, 100), max_size=3)), mask)


logprob = st.builds(TokenLogprob, st.integers(0, 5000), floats | st.just(-math.inf),
                    st.dictionaries(st.integers(0, 5000), floats | st.just(-math.inf), max_size=3),
                    st.none() | st.integers(1, 5000))
results = st.builds(
    StepResult, st.integers(0, 2**40), sampled=st.dictionaries(rid, st.integers(0, 5000), max_size=4),
    accepted=st.dictionaries(rid, ids, max_size=3),
    accepted_logprobs=st.dictionaries(rid, st.lists(logprob, max_size=2), max_size=2),
    logprobs=st.dictionaries(rid, logprob, max_size=3), failed=st.dictionaries(rid, st.text(max_size=20), max_size=2),
    prompt_logprobs=st.dictionaries(rid, st.tuples(st.integers(0, 99), st.lists(logprob, max_size=2)), max_size=2),
    embeddings=st.dictionaries(rid, st.lists(st.floats(-1, 1, width=32), max_size=4), max_size=2),
    error=st.none() | st.text(max_size=20), stage_busy_s=st.lists(st.floats(0, 100), max_size=3),
    stage_comm_s=st.lists(st.floats(0, 100), max_size=3))


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(plans(), st.dictionaries(st.sampled_from(["hidden_states", "residual"]), tensors(torch.float32, 3, 2)))
def test_a_plan_comes_back_exactly(plan, proxy):
    for msg in (PlanMsg(plan, proxy), PlanFailedMsg(plan, "stage 0 failed: boom")):
        assert state(roundtrip(msg)) == state(msg)


@settings(max_examples=150, deadline=None)
@given(results)
def test_a_result_comes_back_exactly(result):
    assert state(roundtrip(ResultMsg(result))) == state(ResultMsg(result))


def test_control_messages_come_back_exactly():
    plan = MemoryPlan(1, (2, 4), 1 << 31, 10, 0, 0, 5, 7, 3, 4096)
    for msg in (ReadyMsg(plan, 1.25), ReadyMsg(error="stage 1: no weights"), StageAlive(2, 17)):
        assert state(roundtrip(msg, CONTROL)) == state(msg)
    for msg in (Heartbeat(), Shutdown()):
        assert state(roundtrip(msg)) == state(msg)


def test_an_unknown_or_misplaced_message_type_is_refused():
    wire, ts = CODEC.encode(Heartbeat())
    with pytest.raises(WireError, match="unknown message type 'Pickled'"):
        CODEC.decode(["Pickled", []], [], RING)
    with pytest.raises(WireError, match="unknown message type 'StepPlan'"):        # a part, not a message
        CODEC.decode(["StepPlan", []], [], RING)
    with pytest.raises(WireError, match="unknown message type 'ReadyMsg'"):        # control, not ring
        CODEC.decode(CODEC.encode(ReadyMsg())[0], [], RING)
    with pytest.raises(WireError, match=r"a message is \[type name, value\]"):
        CODEC.decode({"kind": "plan"}, [], RING)


def test_a_field_of_the_wrong_type_is_refused_naming_it():
    plan = StepPlan(3, [ScheduledSeq("a", 0, 2, True)], token_bitmask=TokenBitmask(["a"], torch.zeros(1, 2,
                                                                                                     dtype=torch.int32)))
    wire, ts = CODEC.encode(PlanMsg(plan))
    wire[1]["plan"]["seqs"][0]["num_tokens"] = "2"
    with pytest.raises(WireError, match=r"^PlanMsg\.plan\.seqs\[0\]\.num_tokens: Expected `int`, got `str`$"):
        CODEC.decode(wire, ts, RING)
    wire, ts = CODEC.encode(PlanMsg(plan))
    with pytest.raises(WireError, match=r"token_bitmask\.bits: a tensor of dtype torch.float32"):
        CODEC.decode(wire, [torch.zeros(1, 2)], RING)
    with pytest.raises(WireError, match=r"token_bitmask\.bits: a tensor of 3 dimensions where 2 belong"):
        CODEC.decode(wire, [torch.zeros(1, 2, 1, dtype=torch.int32)], RING)
    with pytest.raises(WireError, match="the index of a tensor sent with the message"):
        CODEC.decode(wire, [], RING)
    wire[1]["plan"]["surprise"] = None               # a field too many
    with pytest.raises(WireError, match="PlanMsg.plan: Object contains unknown field `surprise`"):
        CODEC.decode(wire, ts, RING)
    del wire[1]["plan"]["surprise"], wire[1]["plan"]["seqs"]
    with pytest.raises(WireError, match="PlanMsg.plan: Object missing required field `seqs`"):
        CODEC.decode(wire, ts, RING)
    bad = CODEC.encode(PlanMsg(StepPlan(0, [], [NewRequestData("a", [1], 1, SamplingParams(), [])])))[0]
    bad[1]["plan"]["new_reqs"][0]["params"]["top_p"] = 2.0
    with pytest.raises(WireError, match=r"new_reqs\[0\]\.params: SamplingParams refused its values: top_p must be a "):
        CODEC.decode(bad, [], RING)
    bad[1]["plan"]["new_reqs"][0]["params"]["top_p"] = True          # a bool is not a number here
    with pytest.raises(WireError, match=r"new_reqs\[0\]\.params\.top_p: Expected `float`, got `bool`"):
        CODEC.decode(bad, [], RING)
    result = json.loads(json.dumps(CODEC.encode(ResultMsg(StepResult(1, logprobs={"a": TokenLogprob(1, -1.0,
                                                                                                    {3: -2.0})})))[0]))
    result[1]["result"]["logprobs"]["a"]["top"] = {"x": -2.0}      # a token id that is not a number
    key = r"ResultMsg\.result\.logprobs\[\.\.\.\]\.top: Expected `int`, got `str` \(a key\)"
    with pytest.raises(WireError, match=key):
        CODEC.decode(result, [], RING)
    result[1]["result"]["logprobs"]["a"] = {"token_id": 1, "logprob": 0.0, "top": {}, "rank": "first"}
    with pytest.raises(WireError, match=r"logprobs\[\.\.\.\]\.rank: Expected `int \| null`, got `str`"):
        CODEC.decode(result, [], RING)


def test_only_the_codecs_types_are_encoded():
    with pytest.raises(WireError, match="dict is not a message type"):
        CODEC.encode({"plan_id": 1})
    with pytest.raises(WireError, match="PlanMsg cannot be encoded: expected SamplingParams, got dict"):
        CODEC.encode(PlanMsg(StepPlan(0, [], [NewRequestData("a", [1], 1, {"max_tokens": 1}, [])])))
    with pytest.raises(WireError, match="ResultMsg cannot be encoded: a complex cannot cross processes"):
        CODEC.encode(ResultMsg(StepResult(0, failed={"a": 1j})))


def _pair() -> tuple[Link, socket.socket]:
    """A link and the raw TCP socket at its other end, on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Link(a, "stage 2"), b


def test_messages_cross_a_link_with_tensors_raw():
    link, other = _pair()
    receiver = Link(other, "stage 1")
    embeds = torch.randn(3, 5, dtype=torch.bfloat16)
    plan = StepPlan(9, [ScheduledSeq("a", 0, 3, True, [7])], [NewRequestData("a", [1, 2, 3], 3, SamplingParams(),
                                                                             [0], embeds)])
    msg = PlanMsg(plan, {"hidden_states": torch.randn(3, 8)[:, ::2]})       # not contiguous
    send_message(link, msg).wait(5)
    send_message(link, Heartbeat()).wait(5)
    assert state(recv_message(receiver, 5)) == state(msg)
    assert isinstance(recv_message(receiver, 5), Heartbeat)
    with pytest.raises(TimeoutError, match="receiving from stage 1 timed out after 0.3 s"):
        recv_message(receiver, 0.3)
    link.close()
    with pytest.raises(LinkError, match="closed"):
        recv_message(receiver, 5)
    receiver.close()


def _frame(header: bytes) -> bytes:
    return PREFIX.pack(MAGIC, len(header)) + header


@pytest.mark.parametrize("frame, why", [
    (b"GET / HTTP/1.1\r\n\r\n", "not a message frame"),
    (PREFIX.pack(MAGIC, 1 << 30), "not a message frame"),                      # a header past the limit
    (_frame(b"{nope"), "not valid JSON"),
    (_frame(b'[[["object",[1]]],["x",0]]'), "unknown dtype or a bad shape"),
    (_frame(b'[[["float32",[1,2,3,4,5,6,7,8,9]]],[]]'), "unknown dtype or a bad shape"),
    (_frame(b'[[["int64",[-1]]],["x",0]]'), "unknown dtype or a bad shape"),
    (_frame(b'[[["float32",[4294967296,65536]]],[]]'), "more than 8 GiB"),
    (_frame(b'{"table":[]}'), "not valid JSON"),
])
def test_a_malformed_frame_is_refused_before_allocating(frame, why):
    link, raw = _pair()
    raw.sendall(frame)
    with pytest.raises(LinkError, match=why):
        link.recv(5)
    link.close()
    raw.close()


def test_no_pickle_on_any_link():
    """Nothing that reaches a link, a store or a stage may unpickle (multiprocessing's own pipes to the
    children a process starts are its business: inherited, unnamed, reachable by nobody else)."""
    for package in ("executor", "parallel", "runtime"):
        for path in (SRC / package).rglob("*.py"):
            text = path.read_text()
            assert "import pickle" not in text and "torch.load" not in text and "pickle.loads" not in text, path
