"""The client ↔ engine core wire (core/wire.py): every message type round-trips with realistic
contents and exact field types, errors cross as records and come back as the same classes, a
malformed frame (a pickle included) is a WireError naming the sender, and core/ imports no pickle.
(Named apart from tests/pipeline/test_wire.py: test modules here share one namespace.)"""
from __future__ import annotations

import ast
import multiprocessing as mp
import pickle
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from stagewise.config import EngineConfig
from stagewise.core.client import EngineClient
from stagewise.core.core import ENGINE_FAULT, EngineCore
from stagewise.core.deltas import DeltaEncoder, OutputAssembler
from stagewise.core.wire import (
    AbortRequests,
    AddRequests,
    EngineDied,
    EngineFacts,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    ErrorRecord,
    LoraUpdated,
    NewRequest,
    OutputDelta,
    Params,
    StopEngine,
    TensorRecord,
    UpdateLora,
    WireError,
    decode_client,
    decode_core,
    encode,
)
from stagewise.errors import CheckpointNotFoundError, EngineDeadError
from stagewise.grammar.limits import GrammarLimits
from stagewise.request import CompletionOutput, RequestOutput, SamplingParams, TokenLogprob

CORE = Path(__file__).parents[2] / "src" / "stagewise" / "core"


def full_params() -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=1, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=-0.25, seed=7, stop=["\n\n", "END"],
                          stop_token_ids=[2, 13], ignore_eos=True, logprobs=5, prompt_logprobs=2, min_tokens=3,
                          skip_special_tokens=False, logit_bias={"42": 2, 7: -1.5}, allowed_token_ids=[1, 2, 42],
                          bad_words=["darn"], include_stop_str_in_output=True, truncate_prompt_tokens=-1,
                          cache_salt="tenant-a",
                          structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})


def lp(token_id: int, rank: int | None = None) -> TokenLogprob:
    return TokenLogprob(token_id, -0.125 * token_id, {token_id: -0.125 * token_id, 99: -3.5}, rank)


def deltas() -> list[OutputDelta]:
    return [OutputDelta("req-1", 5, "é wörld ✓", [17, 18], [lp(17), lp(18)], [None, lp(3, rank=1)], None, None,
                        False, 16, 12.5, 12.25),
            OutputDelta("req-2", 0, "", [], None, None, "error", "The grammar is too deep.", True, 0, None,
                        None, 400)]


def round_trip(msg, decode):
    back = decode(encode(msg))
    assert type(back) is type(msg)
    return back


def test_client_messages_round_trip_with_exact_field_types():
    embeds = torch.randn(3, 8).to(torch.bfloat16)
    greedy = Params.of(SamplingParams(max_tokens=8, temperature=0))
    msg = AddRequests([NewRequest("req-1", [1, 5, 9], None, Params.of(full_params())),
                       NewRequest("req-2", None, TensorRecord.of(embeds), greedy)])
    back = round_trip(msg, decode_client)
    assert back == msg
    params = back.requests[0].params.to_sampling_params()
    assert params == full_params()
    assert type(params.temperature) is int and type(params.logit_bias[7]) is float
    assert params.grammar is not None and params.grammar.key == full_params().grammar.key
    tensor = back.requests[1].input_embeds.to_tensor()
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, embeds)
    assert round_trip(AbortRequests(["req-1", "req-2"]), decode_client) == AbortRequests(["req-1", "req-2"])
    assert round_trip(StopEngine(), decode_client) == StopEngine()
    for update in (UpdateLora(1, "sql", "/adapters/sql", ["tiny"]), UpdateLora(2, "sql")):
        assert round_trip(update, decode_client) == update


def test_params_mirror_every_sampling_params_field():
    from dataclasses import fields
    assert Params.__struct_fields__ == tuple(f.name for f in fields(SamplingParams))


def test_core_messages_round_trip():
    facts = EngineFacts(4096, 65536, "/models/tiny", "tiny", 32000, GrammarLimits(max_bytes=1024, workers=3))
    snapshot = {"num_steps": 40, "kv_usage": 0.5, "finished": {"stop": 3}, "stage_busy_s": [0.25, 1.5],
                "recovery": {"recovering": None, "last_move": {"kind": "join", "node": 1}}}
    for msg in (EngineReady(facts, snapshot), EngineOutputs(123.5, deltas(), snapshot), EngineOutputs(1.0),
                EngineDied("A stage died: exit code -9; restart the server.", deltas()), LoraUpdated(3, ["sql"]),
                LoraUpdated(4, [], "The LoRA adapter 'x' is not loaded; this engine holds none.", "not_found")):
        assert round_trip(msg, decode_core) == msg


@pytest.mark.parametrize("exc", [ValueError("max_tokens must be >= 1."), EngineDeadError("stage 1 died"),
                                 CheckpointNotFoundError("no config.json in /x"), MemoryError("KV cache")])
def test_errors_cross_as_records_and_come_back_as_the_same_class(exc):
    back = round_trip(EngineFailed(ErrorRecord.of(exc)), decode_core).error.to_exception()
    assert type(back) is type(exc) and str(back) == str(exc)


def test_an_error_of_another_library_comes_back_as_its_nearest_base():
    class OutOfMemory(RuntimeError):
        pass
    back = ErrorRecord.of(OutOfMemory("out of memory")).to_exception()
    assert type(back) is RuntimeError and str(back) == "OutOfMemory: out of memory"


def test_deltas_through_the_wire_rebuild_the_cumulative_output():
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    texts = ["Hel", "Hello wo", "Hello"]        # the last one cut by a stop string
    for step, text in enumerate(texts, 1):
        done = step == len(texts)
        out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, list(range(step)), "stop" if done else None,
                                                                 [lp(i) for i in range(step)])],
                            finished=done, num_cached_tokens=1, metrics={"first_token_time": 2.0})
        msg = decode_core(encode(EngineOutputs(3.0, [encoder.encode(out)])))
        got = assembler.apply(msg.deltas[0], [1, 2], None)
        assert got.outputs[0] == out.outputs[0] and got.finished == done


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x92\x01", encode(StopEngine())[:-2]])
def test_a_malformed_frame_is_a_wire_error(frame):
    with pytest.raises(WireError, match="malformed message from the engine core"):
        decode_core(frame)


def test_a_message_for_the_other_side_or_with_a_wrong_field_is_refused():
    with pytest.raises(WireError, match="from the client"):
        decode_client(encode(EngineOutputs(1.0)))
    with pytest.raises(WireError, match=r"Expected `str`, got `int` - at `\$.request_ids\[0\]`"):
        decode_client(msgspec.msgpack.encode({"type": "AbortRequests", "request_ids": [1]}))
    with pytest.raises(WireError, match="Invalid value 'Exec'"):
        decode_client(msgspec.msgpack.encode({"type": "Exec", "code": "import os"}))


def test_a_pickle_is_refused():
    for payload in (pickle.dumps(EngineDied("x")), pickle.dumps({"type": "StopEngine"}),
                    pickle.dumps(RuntimeError("boom"))):
        with pytest.raises(WireError):
            decode_core(payload)
        with pytest.raises(WireError):
            decode_client(payload)


def test_a_bad_tensor_record_is_refused():
    with pytest.raises(WireError, match="bytes of data"):
        TensorRecord("float32", [2, 3], b"\x00" * 8).to_tensor()
    with pytest.raises(WireError, match="cannot be built"):
        TensorRecord("Tensor", [1], b"\x00").to_tensor()
    empty = TensorRecord.of(torch.empty(0, 4, dtype=torch.float16)).to_tensor()
    assert empty.shape == (0, 4) and empty.dtype == torch.float16


def test_core_imports_no_pickle():
    paths = sorted(CORE.glob("*.py"))
    assert paths, f"{CORE} holds no modules"
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = getattr(node, "module", None) or ""
            assert "pickle" not in names and "pickle" not in module, path


class IdleEngine:
    """Just enough of an Engine for a core that never gets a request."""
    max_model_len, kv_capacity_tokens, model_dir, recovering = 64, 256, "/m", None
    config = EngineConfig.from_kwargs(model="m")
    tok = SimpleNamespace(vocab_size=100)

    def has_unfinished(self) -> bool:
        return False

    def fault(self) -> None:
        return None

    def stats(self) -> dict:
        return {"running": 0}

    def abort(self, rid) -> None:
        pass

    def shutdown(self) -> None:
        pass


def failing_engine(config):
    raise CheckpointNotFoundError("There is no config.json in /nowhere; check --model.")


def test_a_start_up_error_is_raised_by_the_client_as_its_own_class():
    with pytest.raises(CheckpointNotFoundError, match=r"^There is no config.json in /nowhere; check --model.$"):
        EngineClient(SimpleNamespace(), engine_factory=failing_engine, tokenizer=object(), in_process=True)


def test_a_malformed_frame_from_the_core_fails_the_client_with_a_sentence_not_a_crash():
    client = EngineClient(SimpleNamespace(), engine_factory=lambda c: IdleEngine(), tokenizer=object(), in_process=True)
    real, (reader, writer) = client._pipes.from_core, mp.Pipe(duplex=False)
    try:
        client._pipes.from_core = reader          # a pipe of the test's own: nothing else writes it
        writer.send_bytes(pickle.dumps(EngineOutputs(1.0)))
        client._on_readable()
        assert client.dead is not None and "message the server cannot read" in client.dead
        assert not client.is_healthy
    finally:
        client._pipes.from_core = real
        client.stop()


def test_a_malformed_frame_from_the_client_ends_the_core_with_engine_died():
    core_in, to_core = mp.Pipe(duplex=False)
    from_core, core_out = mp.Pipe(duplex=False)
    to_core.send_bytes(pickle.dumps(StopEngine()))
    assert EngineCore(IdleEngine(), core_in, core_out).run() == 1
    assert decode_core(from_core.recv_bytes()) == EngineDied(ENGINE_FAULT)
