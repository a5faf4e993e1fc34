"""Dense families with their own details (SmolLM3's no-rope layers, OLMo 2's norm placement, Granite's
multipliers) against HF transformers (fp32): prompt logits and greedy tokens at PP=1 and PP=2 (the
split falls between layers of different kinds where a family has kinds), input embeddings, mixed
prefill batches, and the one-call C decode left to the plain Llama blocks it expresses."""
from __future__ import annotations

import pytest
import torch

from stagewise.model.attention import AttentionMetadata

DENSE_FAMILIES = ("smollm3", "olmo2", "granite", "phi3", "phi4_mini", "gemma3")
PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9))]  # 5, 17 and 45 tokens


@pytest.fixture(scope="session", params=DENSE_FAMILIES)
def dense_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


def _prompts(model_dir) -> list[list[int]]:
    """The prompts transformers rotates as we do: with long-rope beyond the original length, those
    longer than it (transformers uses the short factors within it, see LongRopeEmbedding)."""
    from stagewise.checkpoint.files import load_hf_config
    from stagewise.model.layers import rope_parameters
    params = rope_parameters(load_hf_config(model_dir))
    if params["rope_type"] != "longrope":
        return PROMPTS
    return [p for p in PROMPTS if len(p) > params["original_max_position_embeddings"]]


@pytest.mark.parametrize("pp_size", [1, 2])
def test_logits_and_greedy_match_hf(dense_dir, eager_pipeline, hf_logits, hf_greedy, pp_size):
    pipe = eager_pipeline(dense_dir, pp_size=pp_size)
    prompts = _prompts(dense_dir)
    for ids in prompts:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(dense_dir, ids), atol=1e-4, rtol=0)
    assert [pipe.greedy(ids, 16) for ids in prompts[-2:]] == hf_greedy(dense_dir, prompts[-2:], 16)


@pytest.mark.parametrize("pp_size", [1, 2])
def test_phi3_within_the_original_length_takes_the_short_factors(phi3_short_dir, eager_pipeline, hf_logits,
                                                                  hf_greedy, pp_size):
    """A long-rope model whose context is its original length (32): the short factors, as transformers'."""
    pipe = eager_pipeline(phi3_short_dir, pp_size=pp_size)
    for ids in PROMPTS[:2]:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(phi3_short_dir, ids), atol=1e-4, rtol=0)
    assert pipe.greedy(PROMPTS[0], 16) == hf_greedy(phi3_short_dir, PROMPTS[:1], 16)[0]


def test_long_rope_factor_sets_differ(phi3_dir, phi3_short_dir, hf_logits):
    """The two fixtures above test different rotations (the same weights, other factors)."""
    assert not torch.allclose(hf_logits(phi3_dir, PROMPTS[0]), hf_logits(phi3_short_dir, PROMPTS[0]), atol=1e-2)


def test_input_embeds_equal_token_ids(dense_dir, eager_pipeline, hf_logits):
    """Given embeddings go through the family's input scaling as HF's do (Granite's multiplier)."""
    pipe = eager_pipeline(dense_dir, pp_size=2)
    ids = _prompts(dense_dir)[-1]
    embeds = pipe.stages[0].embed_tokens(torch.tensor(ids))
    by_embeds = pipe.prefill_logits(ids, input_embeds=embeds)
    torch.testing.assert_close(by_embeds, pipe.prefill_logits(ids), atol=1e-6, rtol=0)
    torch.testing.assert_close(by_embeds, hf_logits(dense_dir, ids, inputs_embeds=embeds), atol=1e-4, rtol=0)


def test_mixed_prefill_batch_matches_hf(dense_dir, eager_pipeline, hf_logits):
    pipe = eager_pipeline(dense_dir)
    lens = [len(p) for p in PROMPTS]
    meta = AttentionMetadata.build(lens, lens, [pipe.table(i) for i in range(3)], pipe.block_size)
    pipe.reset()
    hidden = pipe.forward(torch.tensor([t for p in PROMPTS for t in p]), torch.cat([torch.arange(n) for n in lens]),
                          meta)
    for ids, rows in zip(PROMPTS, pipe.stages[-1].compute_logits(hidden).split(lens)):
        if ids in _prompts(dense_dir):
            torch.testing.assert_close(rows, hf_logits(dense_dir, ids), atol=1e-4, rtol=0)


def test_smollm3_split_falls_between_a_nope_and_a_rope_layer(smollm3_dir, eager_pipeline):
    first, second = eager_pipeline(smollm3_dir, pp_size=2).stages
    assert not first.layers[1].self_attn.use_rope and second.layers[2].self_attn.use_rope


def test_only_plain_llama_blocks_plan_the_one_call_decode(dense_dir, eager_pipeline):
    """The C decode of packed Llama blocks has no no-rope layers, multipliers, post-norms or partial
    rotary: those families' stages plan none and run their modules; Phi-3's blocks (fused projections,
    long-rope tables) are plain ones and run it. The greedy tests check the tokens of both."""
    from stagewise.kernels import layers as cpu_layers
    if not cpu_layers.available():
        pytest.skip("the one-call decode op is not built here")
    plan = eager_pipeline(dense_dir).stages[0]._plan_decode_layers()
    assert (plan is not None) == (dense_dir.name.startswith("tiny-phi3"))


def test_bfloat16_stage_runs_close_to_float32(dense_dir, eager_pipeline):
    ids = PROMPTS[1]
    full = eager_pipeline(dense_dir).prefill_logits(ids)
    half = eager_pipeline(dense_dir, pp_size=2, dtype=torch.bfloat16).prefill_logits(ids)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert (half - full).abs().max() < 0.1 * full.abs().max()


def test_gemma3_split_between_window_and_global_layers_matches_hf(gemma3_dir, eager_pipeline, hf_logits, hf_greedy):
    """Five window layers on one stage, the global layer on the next (the boundary between kinds)."""
    pipe = eager_pipeline(gemma3_dir, pp_size=2, partition=[5, 1])
    assert [m.stage.end - m.stage.start for m in pipe.stages] == [5, 1]
    assert pipe.stages[0].layers[4].self_attn.window == 8 and pipe.stages[1].layers[5].self_attn.window is None
    torch.testing.assert_close(pipe.prefill_logits(PROMPTS[2]), hf_logits(gemma3_dir, PROMPTS[2]), atol=1e-4, rtol=0)
    assert pipe.greedy(PROMPTS[1], 24) == hf_greedy(gemma3_dir, PROMPTS[1:2], 24)[0]


def test_window_layers_refuse_full_graph_batches():
    """Window layers read the step's live metadata, which full graphs' batches (`static`) freeze."""
    from types import SimpleNamespace

    from stagewise.model.sink_attention import sink_attention
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="full graphs freeze"):
        sink_attention(SimpleNamespace(static=True), 0, q, q[:, :2], q[:, :2], 0.25, None, 8)  # type: ignore[arg-type]


def test_gemma3_attention_soft_capping_is_refused_in_one_sentence(gemma3_dir):
    from stagewise.checkpoint.files import load_hf_config
    from stagewise.model.llama_dense import Gemma3ForCausalLM
    from stagewise.parallel.partition import stage_infos
    config = load_hf_config(gemma3_dir)
    config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        Gemma3ForCausalLM(config, stage_infos(6, 1)[0], torch.float32)


def test_auto_graphs_leave_window_models_eager(tmp_path):
    """A Gemma 3 big enough for auto to compile (hidden 512) runs eager: its window layers attend
    outside captured graphs; a Qwen3 of that size compiles (the rule can fail)."""
    import transformers as tf

    from stagewise.config import EngineConfig
    from stagewise.graph.policy import COMPILE_MIN_HIDDEN, policy_for
    tf.Gemma3TextConfig(hidden_size=COMPILE_MIN_HIDDEN, architectures=["Gemma3ForCausalLM"]).save_pretrained(
        tmp_path / "gemma")
    tf.Qwen3Config(hidden_size=COMPILE_MIN_HIDDEN, architectures=["Qwen3ForCausalLM"]).save_pretrained(
        tmp_path / "qwen3")
    gemma = policy_for(EngineConfig.from_kwargs(model=str(tmp_path / "gemma")), "cpu")
    assert gemma.backend == "off" and any("sliding-window" in line for line in gemma.log_lines)
    from stagewise.kernels.build import cxx_compiler
    if cxx_compiler() is not None:
        assert policy_for(EngineConfig.from_kwargs(model=str(tmp_path / "qwen3")), "cpu").backend == "compiled"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "phi4_mini", "olmo2"])
def test_llm_at_pp1_and_pp2_matches_hf(family, request, hf_greedy):
    """The engine end to end (PP=2 in stage processes, its scheduler, its graph policy) per family kind."""
    from stagewise import LLM, SamplingParams
    model_dir = request.getfixturevalue(f"{family}_dir")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = hf_greedy(model_dir, PROMPTS[1:], 12)
    for pp in (1, 2):
        with LLM(model=str(model_dir), pp_size=pp) as llm:
            out = llm.generate(prompt_token_ids=PROMPTS[1:], sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == want, pp


@pytest.mark.parametrize("family,qtype", [("olmo2", "F32"), ("olmo2", "Q8_0"), ("granite", "F32"),
                                          ("granite", "Q8_0"), ("smollm3_nope4", "F32")])
def test_gguf_matches_hf_at_pp1_and_pp2(family, qtype, request, tiny_gguf, eager_pipeline, hf_logits, hf_greedy,
                                        gguf_tools, tmp_path):
    """Files as llama.cpp's converter writes them: `olmo2` (post_attention_norm, post_ffw_norm, q/k rows
    as HF's) and `granite` (the multipliers as embedding/residual/logit/attention scales, q/k rows
    permuted), `smollm3` (q/k rows permuted, every 4th layer without rope as llama.cpp fixes it);
    Q8_0 against transformers on the file's dequantized values."""
    from stagewise.checkpoint.files import load_hf_config as config_of
    model_dir = request.getfixturevalue(f"{family}_dir")
    path = tiny_gguf(family, qtype)
    ref = model_dir if qtype == "F32" else gguf_tools.dequantized_hf_dir(model_dir, tmp_path / "dq", qtype)
    assert config_of(path).architectures == config_of(model_dir).architectures
    if family.startswith("smollm3"):
        assert config_of(path).no_rope_layers == [1, 1, 1, 0] == config_of(model_dir).no_rope_layers
    for pp in (1, 2):
        pipe = eager_pipeline(path, pp_size=pp)
        torch.testing.assert_close(pipe.prefill_logits(PROMPTS[1]), hf_logits(ref, PROMPTS[1]),
                                   atol=1e-4 if qtype == "F32" else 2e-3, rtol=0)
    assert pipe.greedy(PROMPTS[2], 12) == hf_greedy(ref, PROMPTS[2:], 12)[0]


@pytest.mark.parametrize("family,qtype", [("gemma3_hd", "F32"), ("gemma3_hd", "Q8_0"), ("phi3", "F32"),
                                          ("phi4_mini", "F32")])
def test_gguf_gemma3_and_phi3_match_hf_at_pp1_and_pp2(family, qtype, request, tiny_gguf, eager_pipeline, hf_logits,
                                                      hf_greedy, gguf_tools, tmp_path):
    """Files as llama.cpp's converter writes them: `gemma3` (norm scales stored with the 1 added,
    window layers by its fixed period of 6, the window layers' rope base, linear scaling on the global
    ones, the soft cap) and `phi3` (fused qkv and gate/up, long-rope factors as tensors, partial
    rotary as the rope dims); Q8_0 against transformers on the file's dequantized values."""
    from stagewise.checkpoint.files import load_hf_config as config_of
    model_dir = request.getfixturevalue(f"{family}_dir")
    path = tiny_gguf(family, qtype)
    ref = model_dir if qtype == "F32" else gguf_tools.dequantized_hf_dir(model_dir, tmp_path / "dq", qtype)
    mine, hf = config_of(path), config_of(model_dir)
    assert mine.architectures == hf.architectures
    if family.startswith("gemma3"):
        assert (mine.layer_types, mine.sliding_window) == (hf.layer_types, hf.sliding_window)
    prompts = _prompts(model_dir)
    for pp in (1, 2):
        pipe = eager_pipeline(path, pp_size=pp)
        torch.testing.assert_close(pipe.prefill_logits(prompts[0]), hf_logits(ref, prompts[0]),
                                   atol=1e-4 if qtype == "F32" else 2e-3, rtol=0)
        assert pipe.greedy(prompts[-1], 12) == hf_greedy(ref, prompts[-1:], 12)[0]


@pytest.mark.parametrize("family", ["smollm3", "granite", "gemma3"])
def test_tensor_parallel_ranks_give_the_one_process_tokens(family, request, eager_pipeline, tp_threads):
    """Heads split over 2 ranks (window layers, no-rope layers and multipliers included)."""
    model_dir = request.getfixturevalue(f"{family}_dir")
    want = eager_pipeline(model_dir).greedy(PROMPTS[1], 12)
    pipes = tp_threads.sharded(model_dir, 2)
    assert tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPTS[1], 12)) == [want, want]


@pytest.mark.parametrize("family", ["olmo2", "phi3"])
def test_families_without_tensor_parallelism_refuse_it_in_one_sentence(family, request):
    from stagewise.checkpoint.files import load_hf_config
    from stagewise.model.registry import get_model_class
    from stagewise.parallel import tp
    config = load_hf_config(request.getfixturevalue(f"{family}_dir"))
    with pytest.raises(ValueError, match="runs with tp_size 1"):
        tp.check_model(config, get_model_class(config.architectures[0]), 2)


def test_gemma3_quantized_at_load_keeps_its_embedding_scale(gemma3_dir, eager_pipeline):
    """int8 at load quantizes the projections; the scaled token embedding stays float (and scaled)."""
    from stagewise.model.llama_dense import ScaledEmbedding
    full = eager_pipeline(gemma3_dir).prefill_logits(PROMPTS[1])
    pipe = eager_pipeline(gemma3_dir, quantization="int8")
    assert type(pipe.stages[0].embed_tokens) is ScaledEmbedding
    assert (pipe.prefill_logits(PROMPTS[1]) - full).abs().max() < 0.1 * full.abs().max()


@pytest.mark.parametrize("pattern,want", [(3, "SSGSSG"), ([True, False, True, True, True, False], "SGSSSG"),
                                          (1, "GGGGGG")])
def test_gguf_gemma3_window_layers_follow_the_pattern_key(pattern, want, gemma3_hd_dir, gguf_tools, tmp_path):
    """`gemma3.attention.sliding_window_pattern`, a period (the last layer of each global) or a flag per layer."""
    import gguf
    from transformers import AutoConfig

    from stagewise.checkpoint.files import load_hf_config
    config = AutoConfig.from_pretrained(gemma3_hd_dir)
    writer = gguf.GGUFWriter(str(tmp_path / "p.gguf"), "gemma3")
    gguf_tools.write_hparams(writer, config, "gemma3")
    writer.add_sliding_window_pattern(pattern)
    for name, array in gguf_tools.gguf_tensors(gemma3_hd_dir, config, "gemma3").items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    kinds = load_hf_config(tmp_path / "p.gguf").layer_types
    assert "".join("S" if k == "sliding_attention" else "G" for k in kinds) == want
