"""Mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE) against HF transformers (fp32):
prompt logits and greedy tokens at PP=1 and PP=2, mixed batches, experts quantized at load, tensor
parallelism, decode reading only the routed experts, and the planner holding every expert."""
from __future__ import annotations

import pytest
import torch

from stagewise.checkpoint.files import load_hf_config
from stagewise.model import moe
from stagewise.model.attention import AttentionMetadata
from stagewise.model.loader import load_model
from stagewise.parallel.partition import StageInfo

MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")
PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9))]  # 5, 17 and 45 tokens


@pytest.fixture(scope="session", params=MOE_FAMILIES)
def moe_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.mark.parametrize("pp_size", [1, 2])
def test_logits_and_greedy_match_hf(moe_dir, eager_pipeline, hf_logits, hf_greedy, pp_size):
    pipe = eager_pipeline(moe_dir, pp_size=pp_size)
    for ids in PROMPTS:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(moe_dir, ids), atol=1e-4, rtol=0)
    assert [pipe.greedy(ids, 16) for ids in PROMPTS[1:]] == hf_greedy(moe_dir, PROMPTS[1:], 16)


def test_mixed_prefill_batch_matches_hf(moe_dir, eager_pipeline, hf_logits):
    """Three prompts in one step: rows of several sequences grouped by expert together."""
    pipe = eager_pipeline(moe_dir)
    lens = [len(p) for p in PROMPTS]
    meta = AttentionMetadata.build(lens, lens, [pipe.table(i) for i in range(3)], pipe.block_size)
    pipe.reset()
    hidden = pipe.forward(torch.tensor([t for p in PROMPTS for t in p]), torch.cat([torch.arange(n) for n in lens]),
                          meta)
    for ids, rows in zip(PROMPTS, pipe.stages[-1].compute_logits(hidden).split(lens)):
        torch.testing.assert_close(rows, hf_logits(moe_dir, ids), atol=1e-4, rtol=0)


def test_decode_reads_only_the_routed_experts(qwen3_moe_dir, eager_pipeline, monkeypatch):
    """A batch-1 decode step calls each MoE layer's experts k times at most (one call per active
    expert and projection), and exactly the experts the router chose."""
    pipe = eager_pipeline(qwen3_moe_dir)
    calls: list[tuple[int, int]] = []
    routed: list[set[int]] = []
    real_linear, real_route = moe.expert_linear, moe.route
    monkeypatch.setattr(moe, "expert_linear", lambda x, proj, e, rows: calls.append((id(proj), e))
                        or real_linear(x, proj, e, rows))
    monkeypatch.setattr(moe, "route", lambda logits, k, norm: (out := real_route(logits, k, norm))
                        and (routed.append(set(out[1].reshape(-1).tolist())) or out))
    logits = pipe.prefill_logits(PROMPTS[0])
    calls.clear()
    routed.clear()
    meta = AttentionMetadata.build([1], [6], [pipe.table(0)], pipe.block_size)
    pipe.forward(logits[-1:].argmax(-1), torch.tensor([5]), meta)
    config = load_hf_config(qwen3_moe_dir)
    assert len(routed) == 2         # layers 0 and 2 route; layer 1 is dense
    assert len(calls) == 2 * 2 * config.num_experts_per_tok       # gate/up and down per chosen expert
    by_proj: dict[int, set[int]] = {}
    for proj, expert in calls:
        by_proj.setdefault(proj, set()).add(expert)
    assert sorted(map(sorted, by_proj.values())) == sorted(map(sorted, routed + routed))


def _quantized_reference(model_dir, out, qtype: str, routers: bool = False):
    """The HF checkpoint with every expert matrix (and the dense ones) through `qtype` and back, the
    routers kept float unless `routers` (a GGUF file that stores them quantized): the values the
    quantized stage holds."""
    import gguf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quant = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, param in model.named_parameters():
            # (a GGUF file stores the shared expert's gate squeezed to [H], as float)
            if param.dim() < 2 or name.endswith("shared_expert_gate.weight") or not routers and name.endswith(
                    ("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                continue
            rows = param.reshape(-1, param.shape[-1]).numpy()
            param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, quant), quant))
                        .reshape(param.shape))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_quantized_at_load_match_hf_on_their_values(family, request, eager_pipeline, hf_logits, tmp_path):
    from stagewise.model.quantized import QuantLinear
    model_dir = request.getfixturevalue(f"{family}_dir")
    pipe = eager_pipeline(model_dir, pp_size=2, quantization="int8")
    blocks = [m for stage in pipe.stages for m in stage.modules() if isinstance(m, moe.SparseMoE)]
    assert blocks and all(isinstance(b.gate_up_exps, QuantLinear) and isinstance(b.down_exps, QuantLinear)
                          and b.gate_up_exps.segments[0].qtype.name == "Q8_0" for b in blocks)
    assert not any(isinstance(b.gate, QuantLinear) for b in blocks)       # routers stay float
    reference = _quantized_reference(model_dir, tmp_path / "q8", "Q8_0")
    got = pipe.prefill_logits(PROMPTS[1])
    torch.testing.assert_close(got, hf_logits(reference, PROMPTS[1]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss"])
def test_tensor_parallel_ranks_give_the_one_process_tokens(family, request, eager_pipeline, tp_threads):
    """Attention and dense MLPs split over 2 ranks; each rank holds every expert (replicated); gpt-oss's
    sinks follow each rank's q heads."""
    model_dir = request.getfixturevalue(f"{family}_dir")
    want = eager_pipeline(model_dir).greedy(PROMPTS[1], 12)
    pipes = tp_threads.sharded(model_dir, 2)
    assert tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPTS[1], 12)) == [want, want]


def test_tensor_parallel_ranks_on_a_quantized_moe_gguf(qwen3_moe_dir, tiny_gguf, eager_pipeline, tp_threads):
    path = tiny_gguf("qwen3_moe", "Q8_0")
    want = eager_pipeline(path).greedy(PROMPTS[1], 12)
    pipes = tp_threads.sharded(path, 2)
    assert tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPTS[1], 12)) == [want, want]


def test_olmoe_refuses_tensor_parallelism_in_one_sentence(olmoe_dir):
    from stagewise.model.registry import get_model_class
    from stagewise.parallel import tp
    with pytest.raises(ValueError, match="OlmoeForCausalLM runs with tp_size 1"):
        tp.check_model(load_hf_config(olmoe_dir), get_model_class("OlmoeForCausalLM"), 2)


def test_the_plan_counts_every_expert_as_held(qwen3_moe_dir, tiny_gguf):
    """Memory: the planner's per-layer bytes (`stagewise plan`, the cluster plan) hold all of a layer's
    experts, float or in the file's quantized type; a dense layer holds its MLP."""
    from stagewise.model.quantized import weight_bytes
    from stagewise.planning.report import ModelBytes
    config = load_hf_config(qwen3_moe_dir)
    h, experts, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
    attention = (64 + 2 * 32 + 64) * h + 2 * 16 + 2 * h            # q, k, v, o, q/k norms, two layer norms
    router = experts * h
    want = [4 * (attention + router + experts * 3 * h * inter), 4 * (attention + 3 * h * config.intermediate_size)]
    assert ModelBytes.measure(str(qwen3_moe_dir), torch.float32, None, True).layers == (want[0], want[1], want[0])
    q8 = ModelBytes.measure(str(tiny_gguf("qwen3_moe", "Q8_0")), torch.float32, None, True).layers
    model = load_model(tiny_gguf("qwen3_moe", "Q8_0"), StageInfo.single(3), torch.float32)
    assert q8 == tuple(weight_bytes(model.layers[i]) for i in range(3))
    expert_q8 = experts * 3 * h * inter * 34 // 32          # Q8_0: 34 bytes per 32 weights
    assert q8[0] > expert_q8 and q8[0] - expert_q8 < want[0] - 4 * experts * 3 * h * inter + 4096


def test_unsupported_architecture_names_itself_and_the_supported_list():
    from stagewise.model.registry import get_model_class
    with pytest.raises(ValueError, match=r"'DeepseekV3ForCausalLM' is not supported; supported architectures: .*"
                                         r"MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        get_model_class("DeepseekV3ForCausalLM")


# ---- GGUF files written from the same weights (as llama.cpp's converter stacks the experts) ----------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_f32_gguf_matches_hf_at_pp1_and_pp2(family, request, tiny_gguf, eager_pipeline, hf_logits, hf_greedy):
    from stagewise.checkpoint.files import load_hf_config as config_of
    model_dir, path = request.getfixturevalue(f"{family}_dir"), tiny_gguf(family)
    assert config_of(path).architectures == config_of(model_dir).architectures
    for pp in (1, 2):
        pipe = eager_pipeline(path, pp_size=pp)
        torch.testing.assert_close(pipe.prefill_logits(PROMPTS[1]), hf_logits(model_dir, PROMPTS[1]), atol=1e-4,
                                   rtol=0)
    assert pipe.greedy(PROMPTS[2], 12) == hf_greedy(model_dir, PROMPTS[2:], 12)[0]


def test_transformers_reads_the_qwen3moe_gguf_as_we_do(qwen3_moe_768_dir, tmp_path, gguf_tools, eager_pipeline):
    """transformers' own GGUF loader (which knows qwen3moe) on the same file: the writer's layout is the
    one llama.cpp's converter writes, and both read it alike."""
    from transformers import AutoModelForCausalLM
    path = gguf_tools.write_gguf(qwen3_moe_768_dir, tmp_path / "qwen3moe.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[1]])).logits[0]
    torch.testing.assert_close(eager_pipeline(path).prefill_logits(PROMPTS[1]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family,qtype", [("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0"), ("qwen2_moe", "Q8_0")])
def test_quantized_gguf_experts_stay_quantized_and_match_hf(family, qtype, request, tiny_gguf, eager_pipeline,
                                                            hf_logits, tmp_path):
    from stagewise.model.quantized import QuantLinear
    model_dir = request.getfixturevalue(f"{family}_dir")
    pipe = eager_pipeline(tiny_gguf(family, qtype), pp_size=2)
    blocks = [m for stage in pipe.stages for m in stage.modules() if isinstance(m, moe.SparseMoE)]
    assert blocks and all(isinstance(b.down_exps, QuantLinear) and b.down_exps.segments[0].qtype.name == qtype
                          for b in blocks)
    reference = _quantized_reference(model_dir, tmp_path / "dq", qtype, routers=True)
    torch.testing.assert_close(pipe.prefill_logits(PROMPTS[1]), hf_logits(reference, PROMPTS[1]), atol=1e-4, rtol=0)


def test_mixtral_gguf_with_one_tensor_per_expert_matches_hf(mixtral_dir, tmp_path, gguf_tools, eager_pipeline,
                                                           hf_logits):
    """Mixtral files converted before llama.cpp stacked the experts hold `blk.N.ffn_gate.E.weight`."""
    from transformers import AutoConfig
    stacked = gguf_tools.gguf_tensors(mixtral_dir, AutoConfig.from_pretrained(mixtral_dir), "llama")
    tensors = {}
    for name, array in stacked.items():
        kind = name.split(".")[-2]
        if kind.endswith("_exps"):
            tensors.update({name.replace(f"{kind}.", f"{kind[:-5]}.{e}."): array[e] for e in range(len(array))})
        else:
            tensors[name] = array
    path = gguf_tools.write_gguf(mixtral_dir, tmp_path / "legacy.gguf", tensors=tensors, tokenizer=False)
    torch.testing.assert_close(eager_pipeline(path, pp_size=2).prefill_logits(PROMPTS[1]),
                               hf_logits(mixtral_dir, PROMPTS[1]), atol=1e-4, rtol=0)


def test_the_expert_count_key_is_gguf_pys():
    from gguf.constants import Keys

    from stagewise.checkpoint.gguf_meta import EXPERT_COUNT_KEY
    assert EXPERT_COUNT_KEY == Keys.LLM.EXPERT_COUNT


def test_expert_tensor_of_an_unsupported_type_is_named(qwen3_moe_dir, tmp_path, gguf_tools):
    import gguf
    import numpy as np
    from transformers import AutoConfig
    tensors = gguf_tools.gguf_tensors(qwen3_moe_dir, AutoConfig.from_pretrained(qwen3_moe_dir), "qwen3moe")
    qtype, shape = gguf.GGMLQuantizationType.Q8_1, tensors["blk.2.ffn_down_exps.weight"].shape
    tensors["blk.2.ffn_down_exps.weight"] = (np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype),
                                                      dtype=np.uint8), qtype)
    path = gguf_tools.write_gguf(qwen3_moe_dir, tmp_path / "bad.gguf", tensors=tensors, tokenizer=False)
    with pytest.raises(ValueError, match=r"Tensor blk\.2\.ffn_down_exps\.weight in .* is stored as Q8_1, which "
                                         r"stagewise cannot dequantize"):
        load_model(path, StageInfo.single(3), torch.float32)


@pytest.mark.slow
def test_llm_on_a_quantized_moe_gguf_at_pp1_and_pp2_matches_hf(qwen3_moe_dir, tiny_gguf, hf_greedy, tmp_path):
    """The engine end to end (PP=2 in stage processes) on a Q8_0 Qwen3-MoE file."""
    from stagewise import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = hf_greedy(_quantized_reference(qwen3_moe_dir, tmp_path / "dq", "Q8_0", routers=True), PROMPTS[1:2], 8)
    for pp in (1, 2):
        with LLM(model=str(tiny_gguf("qwen3_moe", "Q8_0")), tokenizer=str(qwen3_moe_dir), pp_size=pp) as llm:
            out = llm.generate(prompt_token_ids=PROMPTS[1:2], sampling_params=params, use_tqdm=False)
        assert [out[0].outputs[0].token_ids] == want, pp



def test_one_row_runs_its_experts_in_one_call_with_the_batch_bits(tiny_gguf, eager_pipeline):
    """Batch-1 decode: the k experts' gate/up of the one row in one kernel call (quantized experts),
    the same bits as the row computed among others (grouped per expert)."""
    from stagewise.model.moe import SparseMoE
    from stagewise.model.quantized import QuantLinear
    pipe = eager_pipeline(tiny_gguf("qwen3_moe", "Q8_0"))
    moe = next(m for m in pipe.stages[0].modules() if isinstance(m, SparseMoE))
    assert isinstance(moe.gate_up_exps, QuantLinear)
    x = torch.randn(3, moe.gate.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = moe(x)
        for i in range(3):
            assert torch.equal(moe(x[i:i + 1]), together[i:i + 1])
