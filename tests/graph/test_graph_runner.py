"""StageGraphRunner on CPU: emulated replay (rerun and tape) equals eager on toy stages."""
import pytest
import torch
from graph_toys import Step, ToyStage, clone_batch, fill_history, kv_caches, toy_pipeline
from tape import TapeBackend

from stagewise.graph.policy import GraphVerdict, decide_verdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.model.attention import ForwardBatch
from stagewise.parallel.partition import stage_infos
from stagewise.parallel.proxy import ProxyTensors

BUCKETS = (4, 8, 16)
CASES = {   # (new tokens, cached tokens) per sequence; all fit bucket 8
    "decode_n1": [(1, 5)],
    "prefill_T-1": [(7, 0)],
    "prefill_T": [(8, 0)],
    "mixed_T-1": [(5, 3), (1, 9), (1, 2)],
    "mixed_T": [(3, 0), (1, 4), (4, 2)],
}
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def make_runner(model, batch, backend="breakable", emulation="tape", decode=False, buckets=BUCKETS, **kw):
    policy = resolve_graph_policy(prefill_graph=backend, buckets=buckets, decode_graph=decode,
                                  decode_graph_max_bs=8, device_type="cpu", full_slots=4)
    kw.setdefault("max_seq_len", 32)   # 8 blocks: keeps full graphs' static attention small
    emulator = TapeBackend if emulation == "tape" else None
    runner = StageGraphRunner(model, model.stage, policy, batch, torch.float32, "cpu", emulator=emulator, **kw)
    runner.capture()
    return runner


def live_proxy(model, T, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return ProxyTensors({k: torch.randn(T, model.hidden_size, generator=gen) for k in model.proxy_keys})


def eager(model, batch, step, proxy=None, input_embeds=None):
    batch.meta = step.meta
    ids = step.input_ids if model.stage.is_first and input_embeds is None else None
    with torch.no_grad():
        return model(ids, step.positions, batch, input_embeds=input_embeds, pp_proxy_tensors=proxy)


def assert_same(a, b):
    if isinstance(a, ProxyTensors):
        assert list(a.keys()) == list(b.keys())
        for k in a.keys():
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def assert_same_kv(batch, ref):
    for c, r in zip(batch.kv_caches, ref.kv_caches):
        if c is not None:
            torch.testing.assert_close(c[:, 1:], r[:, 1:])   # block 0 is scratch: padded rows write there


@pytest.fixture(scope="module", params=[(b, e, p) for b in ("breakable", "full") for e in ("rerun", "tape")
                                        for p in POSITIONS])
def toy_runner(request):
    backend, emulation, position = request.param
    model, batch = toy_pipeline(6, 3)[POSITIONS[position]]
    return make_runner(model, batch, backend, emulation), model, batch


@pytest.mark.parametrize("case", CASES)
def test_replay_equals_eager(toy_runner, case):
    runner, model, batch = toy_runner
    step = Step(CASES[case])
    fill_history([batch])
    ref = clone_batch(batch)
    proxy = None if model.stage.is_first else live_proxy(model, step.num_tokens)
    want = eager(model, ref, step, proxy)
    ids = step.input_ids if model.stage.is_first else None
    got = runner.forward(GraphVerdict("prefill", 8), ids, step.positions, step.meta, proxy=proxy)
    assert (got.num_rows if isinstance(got, ProxyTensors) else got.shape[0]) == step.num_tokens
    assert_same(got, want)
    assert_same_kv(batch, ref)
    assert runner.stats()["replays"][8] >= 1


@pytest.mark.parametrize("emulation", ["rerun", "tape"])
def test_chained_stages_equal_single_stage_eager(emulation):
    stages = toy_pipeline(6, 3)
    runners = [make_runner(m, b, "breakable", emulation) for m, b in stages]
    (single, single_batch), = toy_pipeline(6, 1)
    step = Step([(6, 0), (1, 3)])
    fill_history([b for _, b in stages])
    fill_history([single_batch])   # same seed, same per-layer caches
    verdict = decide_verdict(runners[0].policy, step.num_tokens, step.is_decode_only, len(step.query_lens))
    assert verdict.bucket == 8
    out = None
    for runner, (model, _) in zip(runners, stages):
        ids = step.input_ids if model.stage.is_first else None
        out = runner.forward(verdict, ids, step.positions, step.meta, proxy=out)
        out = out.clone() if isinstance(out, ProxyTensors) else out   # the pipeline copies before sending
    want = eager(single, single_batch, step)
    assert_same(out, want)


@pytest.mark.parametrize("emulation", ["rerun", "tape"])
def test_hidden_only_contract_middle_stage(emulation):
    model, batch = toy_pipeline(6, 3, full_contract=False)[1]
    runner = make_runner(model, batch, "breakable", emulation)
    assert list(runner.inputs.proxy) == ["hidden_states"]
    step = Step(CASES["mixed_T-1"])
    fill_history([batch])
    ref = clone_batch(batch)
    proxy = live_proxy(model, step.num_tokens)
    assert_same(runner.forward(GraphVerdict("prefill", 8), None, step.positions, step.meta, proxy=proxy),
                eager(model, ref, step, proxy))


@pytest.mark.parametrize("backend,emulation", [("breakable", "tape"), ("full", "tape"), ("full", "rerun")])
def test_input_embeds_through_static_buffer(backend, emulation):
    model, batch = toy_pipeline(4, 2)[0]
    runner = make_runner(model, batch, backend, emulation)
    step = Step([(5, 0), (2, 1)])
    with torch.no_grad():
        embeds = model.embed(step.input_ids) + 0.25     # not what the ids would give
    fill_history([batch])
    ref = clone_batch(batch)
    want = eager(model, ref, step, input_embeds=embeds)
    got = runner.forward(GraphVerdict("prefill", 8), None, step.positions, step.meta, input_embeds=embeds)
    assert_same(got, want)
    assert torch.equal(runner.inputs.input_embeds[:7], embeds)
    assert torch.count_nonzero(runner.inputs.input_embeds[7:8]) == 0


@pytest.mark.parametrize("emulation", ["rerun", "tape"])
def test_decode_graphs_by_batch_size(emulation):
    model, batch = toy_pipeline(6, 3)[1]
    runner = make_runner(model, batch, "off", emulation, decode=True)
    assert runner.stats("decode")["buckets"] == [1, 2, 4, 8]
    for seqs in ([(1, 4)], [(1, 3), (1, 9), (1, 1)], [(1, c) for c in range(1, 9)]):
        step = Step(seqs)
        verdict = decide_verdict(runner.policy, step.num_tokens, step.is_decode_only, len(seqs))
        assert verdict.kind == "decode" and verdict.bucket is not None
        fill_history([batch])
        ref = clone_batch(batch)
        proxy = live_proxy(model, step.num_tokens)
        assert_same(runner.forward(verdict, None, step.positions, step.meta, proxy=proxy),
                    eager(model, ref, step, proxy))
        assert_same_kv(batch, ref)
    assert runner.stats("decode")["replays"] == {1: 1, 4: 1, 8: 1}
    assert runner.stats("decode")["padded_tokens"] == 1


@pytest.mark.parametrize("emulation", ["rerun", "tape"])
def test_replay_reads_only_static_buffers(emulation):
    model, batch = toy_pipeline(6, 3)[1]
    runner = make_runner(model, batch, "breakable", emulation)
    step = Step([(6, 0)])
    fill_history([batch])
    ref = clone_batch(batch)
    proxy = live_proxy(model, 6)
    want = eager(model, ref, step, proxy)
    batch.meta = step.meta
    runner.inputs.fill(6, 8, None, step.positions, None, proxy)
    for t in proxy.tensors.values():    # the live inputs change after fill: replay must not see it
        t.fill_(float("nan"))
    step.positions.fill_(100)
    backend = runner._kinds["prefill"].backend
    got = backend.replay((8, "proxy"))
    assert_same(got[:6], want)


def test_stats_count_replays_eager_and_padding():
    model, batch = toy_pipeline(4, 2)[1]
    runner = make_runner(model, batch, "breakable", "rerun")
    policy = runner.policy
    for seqs in ([(3, 0)], [(7, 0)], [(1, 4)], [(20, 0)], [(5, 0), (1, 2)]):
        step = Step(seqs)
        fill_history([batch])
        verdict = decide_verdict(policy, step.num_tokens, step.is_decode_only, len(seqs))
        runner.forward(verdict, None, step.positions, step.meta, proxy=live_proxy(model, step.num_tokens))
    stats = runner.stats()
    assert stats == {"backend": "breakable", "buckets": [4, 8, 16], "replays": {4: 1, 8: 2},
                     "eager": {"padding": 1, "too_large": 1}, "padded_tokens": 1 + 1 + 2}
    assert runner.stats("decode") == {"backend": "off", "buckets": [], "replays": {}, "eager": {},
                                      "padded_tokens": 0}


def test_graphs_off_runs_eager_and_counts_disabled():
    model, batch = toy_pipeline(4, 2)[0]
    policy = resolve_graph_policy("off")
    runner = StageGraphRunner(model, model.stage, policy, batch, torch.float32, "cpu")
    runner.capture()
    step = Step([(5, 0)])
    fill_history([batch])
    ref = clone_batch(batch)
    verdict = decide_verdict(policy, 5, False, 1)
    assert verdict == GraphVerdict("prefill", None, "disabled")
    assert_same(runner.forward(verdict, step.input_ids, step.positions, step.meta), eager(model, ref, step))
    assert runner.stats()["eager"] == {"disabled": 1} and runner.stats()["backend"] == "off"
    assert runner.static_bytes() == 0 and runner.graph_pool_bytes() == 0


def test_memory_accounting_and_capture_time():
    model, batch = toy_pipeline(4, 2)[1]
    runner = make_runner(model, batch, "breakable", "tape")
    # positions [16] int64 + hidden/residual [16, H] float32
    assert runner.static_bytes() == 16 * 8 + 2 * 16 * model.hidden_size * 4
    assert runner.graph_pool_bytes() > 0 and runner.capture_seconds > 0


def test_capture_binds_views_of_fill_memory():
    model, batch = toy_pipeline(4, 2)[1]
    seen = []
    inner = model.forward

    def spy(input_ids, positions, batch, *, input_embeds=None, pp_proxy_tensors=None):
        seen.append((input_ids, positions.data_ptr(), {k: t.data_ptr() for k, t in pp_proxy_tensors.items()},
                     positions.shape[0]))
        return inner(input_ids, positions, batch, input_embeds=input_embeds, pp_proxy_tensors=pp_proxy_tensors)
    model.forward = spy
    runner = make_runner(model, batch, "breakable", "rerun")
    assert [s[3] for s in seen] == [16, 8, 4]           # largest bucket first
    for ids, pos_ptr, proxy_ptrs, _ in seen:
        assert ids is None                               # non-first stage: no token ids
        assert pos_ptr == runner.inputs.positions.data_ptr()
        assert proxy_ptrs == {k: t.data_ptr() for k, t in runner.inputs.proxy.items()}


def test_capture_writes_kv_only_to_scratch_block():
    model, batch = toy_pipeline(4, 1)[0]
    fill_history([batch])
    before = clone_batch(batch)
    make_runner(model, batch, "full", "tape", decode=True)
    assert_same_kv(batch, before)


def test_verdict_for_uncaptured_bucket_is_an_error():
    model, batch = toy_pipeline(4, 2)[1]
    runner = make_runner(model, batch, "breakable", "rerun")
    step = Step([(5, 0)])
    with pytest.raises(RuntimeError, match="did not capture"):
        runner.forward(GraphVerdict("prefill", 12), None, step.positions, step.meta, proxy=live_proxy(model, 5))


def test_full_graph_with_more_requests_than_slots_is_unservable():
    model, batch = toy_pipeline(4, 2)[1]
    runner = make_runner(model, batch, "full", "rerun")
    step = Step([(1, 2)] * 6)
    verdict = decide_verdict(runner.policy, 6, True, 6)
    assert verdict == GraphVerdict("prefill", None, "unservable")
    fill_history([batch])
    ref = clone_batch(batch)
    proxy = live_proxy(model, 6)
    assert_same(runner.forward(verdict, None, step.positions, step.meta, proxy=proxy), eager(model, ref, step, proxy))
    with pytest.raises(RuntimeError, match="unservable"):
        runner.forward(GraphVerdict("prefill", 8), None, step.positions, step.meta, proxy=proxy)


def test_non_first_stage_without_proxy_parameter_fails_at_startup():
    class NoProxy(ToyStage):
        def forward(self, input_ids, positions, batch, input_embeds=None):
            return super().forward(input_ids, positions, batch, input_embeds=input_embeds)
    info = stage_infos(4, 2)[1]
    with pytest.raises(ValueError, match="pp_proxy_tensors"):
        StageGraphRunner(NoProxy(info), info, resolve_graph_policy("off"), ForwardBatch(None, kv_caches(info)),
                         torch.float32, "cpu")
