"""The documented graph behaviours, example by example: buffers, fill, binding, trim, ladders, policy,
verdicts (docs/graphs.md states them)."""
import collections

import pytest
import torch

from stagewise.config import EngineConfig
from stagewise.graph.bind import bind_forward
from stagewise.graph.buckets import decode_bucket_ladder, pick_bucket, prefill_bucket_ladder
from stagewise.graph.buffers import StaticInputs
from stagewise.graph.dummy import DummyMetadata
from stagewise.graph.policy import COMPILE_MIN_HIDDEN, GraphVerdict, decide_verdict, policy_for, resolve_graph_policy
from stagewise.graph.trim import trim_output
from stagewise.parallel.partition import StageInfo
from stagewise.parallel.proxy import FULL_CONTRACT, ProxyTensors

H = 8


def stage(rank, size=2):
    return StageInfo(rank=rank, size=size, start=rank, end=rank + 1, num_layers=size)


def inputs(rank=1, size=2, max_tokens=16, keys=FULL_CONTRACT):
    return StaticInputs(stage(rank, size), max_tokens, H, keys, torch.float32, "cpu")


# buffers: allocated once, filled as snapshots with zeroed padding, embeddings buffer
def test_proxy_buffers_full_contract_non_first_stage():
    assert inputs().proxy_shapes() == {"hidden_states": (16, 8), "residual": (16, 8)}
    assert all(torch.count_nonzero(t) == 0 for t in inputs().proxy.values())


def test_no_proxy_buffers_on_first_or_only_stage():
    assert inputs(rank=0).proxy_shapes() == {}
    assert inputs(rank=0, size=1).proxy_shapes() == {}
    assert inputs(rank=0).input_embeds.shape == (16, 8) and inputs(rank=1).input_embeds is None


def test_fill_copies_live_rows_and_zeroes_padding():
    buf = inputs(max_tokens=8)
    addresses = {k: t.data_ptr() for k, t in buf.proxy.items()}
    for t in buf.proxy.values():
        t.fill_(float("nan"))                               # garbage from an earlier step
    hidden, residual = torch.full((3, H), 2.0), torch.full((3, H), 3.0)
    buf.fill(3, 8, positions=torch.arange(3), proxy=ProxyTensors({"hidden_states": hidden, "residual": residual}))
    assert torch.all(buf.proxy["hidden_states"][:3] == 2.0) and torch.all(buf.proxy["residual"][:3] == 3.0)
    assert torch.count_nonzero(buf.proxy["hidden_states"][3:]) == 0
    assert torch.count_nonzero(buf.proxy["residual"][3:]) == 0
    hidden.fill_(9.0)                                        # a snapshot: later changes do not leak in
    assert torch.all(buf.proxy["hidden_states"][:3] == 2.0)
    buf.fill(3, 8, positions=torch.arange(3), proxy=ProxyTensors({"hidden_states": torch.full((3, H), 4.0)}))
    assert torch.all(buf.proxy["hidden_states"][:3] == 4.0)
    assert {k: t.data_ptr() for k, t in buf.proxy.items()} == addresses   # never reallocated


def test_fill_rejects_wrong_row_count_naming_key_and_shapes():
    proxy = ProxyTensors.__new__(ProxyTensors)   # rows disagree on purpose: bypass the row check
    proxy.tensors = {"hidden_states": torch.zeros(5, H), "residual": torch.zeros(4, H)}
    with pytest.raises(ValueError) as err:
        inputs().fill(5, 8, positions=torch.arange(5), proxy=proxy)
    msg = str(err.value)
    assert "residual" in msg and "(5, 8)" in msg and "(4, 8)" in msg and "Stage 1" in msg


@pytest.mark.parametrize("proxy,words", [
    (None, ["Stage 1", "hidden_states", "(5, 8)", "None"]),
    (ProxyTensors({"hidden_states": torch.zeros(5, 6)}), ["hidden_states", "(5, 6)", "(5, 8)"]),
    (ProxyTensors({"hidden_states": torch.zeros(5, H, dtype=torch.float16)}), ["hidden_states", "float16"]),
    (ProxyTensors({"hidden_states": torch.zeros(5, H), "extra": torch.zeros(5, H)}), ["extra"]),
])
def test_fill_rejects_bad_proxies(proxy, words):
    with pytest.raises(ValueError) as err:
        inputs().fill(5, 8, positions=torch.arange(5), proxy=proxy)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_fill_first_stage_ids_and_embeds():
    buf = inputs(rank=0, max_tokens=8)
    buf.input_ids.fill_(7)
    buf.fill(3, 4, input_ids=torch.tensor([5, 6, 7]), positions=torch.arange(3))
    assert buf.input_ids[:5].tolist() == [5, 6, 7, 0, 7]      # rows past the bucket untouched
    buf.fill(2, 4, positions=torch.arange(2), input_embeds=torch.ones(2, H))
    assert torch.all(buf.input_embeds[:2] == 1) and torch.count_nonzero(buf.input_embeds[2:4]) == 0
    with pytest.raises(ValueError, match="input_ids"):
        buf.fill(2, 4, positions=torch.arange(2))
    with pytest.raises(ValueError, match="bucket"):
        buf.fill(5, 4, input_ids=torch.arange(5), positions=torch.arange(5))


# binding of optional inputs by name
def test_binding_input_embeds_only_at_stage_0_and_error_at_stage_1():
    def forward(ids, pos, batch, input_embeds=None):
        pass
    proxy = ProxyTensors({"hidden_states": torch.zeros(1, H)})
    assert set(bind_forward(forward, 0, True).kwargs(None, proxy)) == {"input_embeds"}
    with pytest.raises(ValueError, match="Stage 1.*pp_proxy_tensors"):
        bind_forward(forward, 1, False)


def test_binding_inputs_embeds_and_proxy_by_name():
    def forward(a, b, c, pp_proxy_tensors=None, inputs_embeds=None):
        pass
    proxy = ProxyTensors({"hidden_states": torch.zeros(1, H)})
    kwargs = bind_forward(forward, 1, False).kwargs(None, proxy)
    assert set(kwargs) == {"inputs_embeds", "pp_proxy_tensors"} and kwargs["pp_proxy_tensors"] is proxy
    assert set(bind_forward(forward, 0, True).kwargs(None, None)) == {"inputs_embeds"}


def test_binding_first_declared_embeds_name_wins_and_kwargs_do_not_count():
    def forward(ids, pos, batch, *, inputs_embeds=None, input_embeds=None, pp_proxy_tensors=None):
        pass
    assert bind_forward(forward, 0, True).embeds_name == "inputs_embeds"

    def loose(ids, pos, batch, **kwargs):
        pass
    assert bind_forward(loose, 0, True).kwargs(None, None) == {}
    with pytest.raises(ValueError, match="embeddings"):
        bind_forward(loose, 0, True).kwargs(torch.zeros(1, H), None)


# trim to the live rows
def test_trim_proxy_to_live_rows():
    out = trim_output(ProxyTensors({"hidden_states": torch.arange(10).reshape(5, 2)}), 3)
    assert isinstance(out, ProxyTensors) and out["hidden_states"].shape == (3, 2)
    assert out["hidden_states"][-1].tolist() == [4, 5]


def test_trim_nested_containers_keep_type():
    t = lambda: torch.zeros(5, 2)
    out = trim_output((t(), [t(), t()]), 3)
    assert isinstance(out, tuple) and isinstance(out[1], list)
    assert [x.shape for x in (out[0], *out[1])] == [(3, 2)] * 3
    Pair = collections.namedtuple("Pair", "a b")
    assert isinstance(trim_output(Pair(t(), t()), 2), Pair)


def test_trim_rejects_dict():
    with pytest.raises(TypeError, match="dict"):
        trim_output({"hidden_states": torch.zeros(5, 2)}, 3)


# bucket ladders
def test_prefill_ladder_8192():
    ladder = prefill_bucket_ladder(8192)
    assert ladder[:9] == [4, 8, 12, 16, 20, 24, 28, 32, 48]
    assert ladder[-1] == 8192 and len(ladder) == 58


def test_prefill_ladder_other_caps():
    assert len(prefill_bucket_ladder(4096)) == 50
    assert prefill_bucket_ladder(50)[-3:] == [32, 48, 50]
    assert prefill_bucket_ladder(3) == [3]
    assert 4608 in prefill_bucket_ladder(5000) and prefill_bucket_ladder(5000)[-1] == 5000
    with pytest.raises(ValueError):
        prefill_bucket_ladder(0)


def test_decode_ladder_and_pick():
    assert decode_bucket_ladder(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_bucket_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert decode_bucket_ladder(3) == [1, 2, 3]
    assert pick_bucket([4, 8, 16], 5) == 8 and pick_bucket([4, 8, 16], 16) == 16
    assert pick_bucket([4, 8, 16], 17) is None


# policy resolved once at start-up
def test_policy_auto_under_pp_is_off_and_logged():
    policy = resolve_graph_policy("auto", pp_size=4, device_type="cuda")
    assert policy.backend == "off" and policy.buckets == ()
    assert any("--prefill-graph breakable" in line for line in policy.log_lines)


def test_policy_explicit_choice_kept_under_pp():
    assert resolve_graph_policy("breakable", pp_size=4, device_type="cuda").backend == "breakable"


def test_policy_auto_single_stage_device_default():
    assert resolve_graph_policy("auto", device_type="cuda").backend == "breakable"
    assert resolve_graph_policy("auto", device_type="cpu").backend == "off"


def test_policy_auto_on_cpu_runs_one_call_models_eager():
    assert resolve_graph_policy("auto", device_type="cpu", hidden_size=COMPILE_MIN_HIDDEN).backend == "compiled"
    assert resolve_graph_policy("auto", device_type="cpu", hidden_size=COMPILE_MIN_HIDDEN - 1).backend == "off"
    eager = resolve_graph_policy("auto", device_type="cpu", hidden_size=576, one_call="m.gguf holds them as Q4_1")
    assert eager.backend == eager.decode_backend == "off"
    assert any("one native call" in line and "--prefill-graph compiled" in line for line in eager.log_lines)
    assert resolve_graph_policy("compiled", device_type="cpu", one_call="--quantization int8").backend == "compiled"
    assert resolve_graph_policy("auto", device_type="cuda", hidden_size=576, one_call="x").backend == "breakable"


def test_policy_for_reads_the_architecture_and_the_packing(llama_dir, qwen3_dir, monkeypatch):
    from stagewise.graph import policy
    from stagewise.kernels.build import mode as build_mode
    config = EngineConfig.from_kwargs(model=str(llama_dir), quantization="int8")
    quantized = policy_for(config, "cpu")
    assert quantized.backend == "off"
    assert any("--quantization int8" in line for line in quantized.log_lines) == (build_mode() != "off")
    float_facts = policy._cpu_facts(str(llama_dir), None)
    packs = build_mode() != "off"                # every kernel build has the packed float kernels
    assert float_facts == (64, "float weights packed for the kernels" if packs else None)
    policy._cpu_facts.cache_clear()
    monkeypatch.setenv("STAGEWISE_PACKED_WEIGHTS", "0")                  # float weights in their own layout
    assert policy._cpu_facts(str(llama_dir), None) == (64, None)
    policy._cpu_facts.cache_clear()
    # Qwen3's q/k norms keep its decode steps on the modules: quantized or not, the hidden size decides
    qwen3 = policy_for(EngineConfig.from_kwargs(model=str(qwen3_dir), quantization="int8"), "cpu")
    assert qwen3.backend == "off" and not any("native call" in line for line in qwen3.log_lines)
    policy._cpu_facts.cache_clear()


@pytest.mark.parametrize("kwargs,cap", [
    (dict(chunked_prefill_size=4096, pp_size=4), 4096),
    (dict(chunked_prefill_size=32768, pp_size=4), 8192),
    (dict(chunked_prefill_size=32768, pp_size=4, max_tokens=16384), 16384),
    (dict(chunked_prefill_size=32768, pp_size=1), 32768),
    (dict(chunked_prefill_size=2048, pp_size=4, buckets=[16, 20000, 8]), 20000),
])
def test_policy_capture_cap(kwargs, cap):
    policy = resolve_graph_policy("breakable", device_type="cuda", **kwargs)
    assert policy.max_tokens == cap and policy.buckets[-1] == cap
    if "buckets" in kwargs:
        assert policy.buckets == (8, 16, 20000)


def test_policy_emulated_without_cuda():
    assert resolve_graph_policy("breakable", device_type="cpu").emulated
    assert resolve_graph_policy("full", device_type="cpu").emulated
    assert not resolve_graph_policy("compiled", device_type="cpu").emulated
    assert not resolve_graph_policy("breakable", device_type="cuda").emulated


@pytest.mark.parametrize("kwargs", [
    dict(prefill_graph="sometimes"), dict(max_tokens=0), dict(buckets=[]), dict(buckets=[4, -8]),
    dict(buckets=[4, 64], max_tokens=32), dict(decode_graph="maybe"), dict(decode_graph=True, decode_graph_max_bs=0),
])
def test_policy_invalid_values(kwargs):
    with pytest.raises(ValueError):
        resolve_graph_policy(**kwargs)


def test_policy_decode_graphs():
    policy = resolve_graph_policy("off", decode_graph=True, decode_graph_max_bs=16, device_type="cuda")
    assert policy.decode_backend == "full" and policy.decode_buckets == (1, 2, 4, 8, 16)
    assert policy.max_rows == 16


# one verdict per step, for every stage
def test_verdict_padding_factor_two():
    policy = resolve_graph_policy("breakable", buckets=[4, 8, 16], device_type="cuda")
    assert decide_verdict(policy, 1, False, 1) == GraphVerdict("prefill", None, "padding")
    assert decide_verdict(policy, 2, False, 1) == GraphVerdict("prefill", 4)
    assert decide_verdict(policy, 3, False, 1) == GraphVerdict("prefill", 4)
    assert decide_verdict(policy, 9, False, 2) == GraphVerdict("prefill", 16)
    assert decide_verdict(policy, 17, False, 1) == GraphVerdict("prefill", None, "too_large")
    assert decide_verdict(policy, 8, False, 1, unservable="logprobs") == GraphVerdict("prefill", None, "logprobs")


def test_verdict_47_tokens_replays_bucket_48():
    policy = resolve_graph_policy("breakable", pp_size=2, device_type="cuda")
    assert decide_verdict(policy, 47, False, 1) == GraphVerdict("prefill", 48)


def test_verdict_decode_buckets_by_batch_size():
    policy = resolve_graph_policy("breakable", buckets=[4, 8, 16], decode_graph=True, decode_graph_max_bs=8,
                                  device_type="cuda")
    assert decide_verdict(policy, 1, True, 1) == GraphVerdict("decode", 1)
    assert decide_verdict(policy, 3, True, 3) == GraphVerdict("decode", 4)
    assert decide_verdict(policy, 3, False, 2) == GraphVerdict("prefill", 4)      # not decode-only
    assert decide_verdict(policy, 12, True, 12) == GraphVerdict("prefill", 16)    # past decode buckets
    off = resolve_graph_policy("off", device_type="cuda")
    assert decide_verdict(off, 1, True, 1) == GraphVerdict("prefill", None, "disabled")


def test_compiled_policy_adds_a_few_rows_decode_graph():
    policy = resolve_graph_policy("compiled", chunked_prefill_size=512, decode_graph_max_bs=32, device_type="cpu")
    assert (policy.backend, policy.buckets) == ("compiled", (512,))
    assert (policy.decode_backend, policy.decode_buckets) == ("compiled", (32,))
    assert any("few rows" in line for line in policy.log_lines)
    one_graph = resolve_graph_policy("compiled", decode_graph="off", device_type="cpu")
    assert one_graph.decode_backend == "off" and any("--decode-graph off" in x for x in one_graph.log_lines)
    assert resolve_graph_policy("off", device_type="cpu").decode_backend == "off"


def test_verdict_small_steps_take_the_few_rows_graph():
    policy = resolve_graph_policy("compiled", chunked_prefill_size=512, decode_graph_max_bs=32, device_type="cpu")
    assert decide_verdict(policy, 1, True, 1) == GraphVerdict("decode", 1)
    assert decide_verdict(policy, 5, False, 1) == GraphVerdict("decode", 5)       # a verify step, a short prefill
    assert decide_verdict(policy, 32, True, 32) == GraphVerdict("decode", 32)
    assert decide_verdict(policy, 33, True, 33) == GraphVerdict("prefill", 33)    # past the cap: the prefill graph
    assert decide_verdict(policy, 513, False, 2) == GraphVerdict("prefill", None, "too_large")
    assert decide_verdict(policy, 4, False, 1, unservable="logprobs") == GraphVerdict("prefill", None, "logprobs")


def test_verdict_full_graph_slots():
    policy = resolve_graph_policy("full", buckets=[8, 16], full_slots=4, device_type="cuda")
    assert decide_verdict(policy, 8, False, 4) == GraphVerdict("prefill", 8)
    assert decide_verdict(policy, 8, False, 5) == GraphVerdict("prefill", None, "unservable")


def test_policy_and_buckets_do_not_import_torch():
    """The driver calls these every step; they stay plain Python (package __init__ aside)."""
    import ast

    import stagewise.graph.buckets as buckets
    import stagewise.graph.policy as policy
    for module in (buckets, policy):
        tree = ast.parse(open(module.__file__).read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(name.split(".")[0] == "torch" for name in names), module.__name__


# capture dummy metadata
@pytest.mark.parametrize("bucket", [1, 3, 8])
def test_dummy_metadata_slice_equals_fresh_build(bucket):
    dummy = DummyMetadata(block_size=4)
    dummy.get(16)
    sliced, fresh = dummy.get(bucket), dummy.build(bucket)
    assert sliced.num_tokens == fresh.num_tokens == bucket
    assert torch.equal(sliced.slot_mapping, fresh.slot_mapping) and sliced.slot_mapping.max() == 0
    for a, b in zip(sliced.groups, fresh.groups):
        for name in vars(a):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
