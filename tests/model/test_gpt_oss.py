"""gpt-oss against HF transformers (fp32): attention sinks, window-8 sliding layers between full ones,
YaRN rope, biased router and experts with the clamped SwiGLU; prompt logits and greedy tokens at PP=1
and PP=2, a batch mixing fresh prompts, a continued prefill and decode rows; YaRN tables equal to
transformers' for other settings too."""
from __future__ import annotations

import json

import pytest
import torch

from stagewise.model.attention import AttentionMetadata
from stagewise.model.layers import rope_attention_scaling, rope_inv_freq, rope_parameters

PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9))]  # 5, 17 and 45 tokens: the longer two pass the window of 8


@pytest.mark.parametrize("pp_size", [1, 2])
def test_logits_and_greedy_match_hf(gpt_oss_dir, eager_pipeline, hf_logits, hf_greedy, pp_size):
    pipe = eager_pipeline(gpt_oss_dir, pp_size=pp_size)
    for ids in PROMPTS:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(gpt_oss_dir, ids), atol=1e-4, rtol=0)
    assert [pipe.greedy(ids, 16) for ids in PROMPTS[1:]] == hf_greedy(gpt_oss_dir, PROMPTS[1:], 16)


def test_mixed_step_matches_hf(gpt_oss_dir, eager_pipeline, hf_logits):
    """One step holding a fresh prompt, the last 20 rows of a prompt whose first 25 are cached, and
    a decode row: each row's logits equal transformers' over the whole sequence."""
    pipe = eager_pipeline(gpt_oss_dir)
    long, fresh, short = PROMPTS[2], PROMPTS[1], PROMPTS[0]
    pipe.reset()
    first = AttentionMetadata.build([25, 4], [25, 4], [pipe.table(0), pipe.table(1)], pipe.block_size)
    pipe.forward(torch.tensor(long[:25] + short[:4]), torch.cat([torch.arange(25), torch.arange(4)]), first)
    lens = [len(fresh), 20, 1]
    meta = AttentionMetadata.build(lens, [len(fresh), 45, 5], [pipe.table(2), pipe.table(0), pipe.table(1)],
                                   pipe.block_size)
    ids = torch.tensor(fresh + long[25:] + short[4:])
    positions = torch.cat([torch.arange(len(fresh)), torch.arange(25, 45), torch.tensor([4])])
    rows = pipe.stages[-1].compute_logits(pipe.forward(ids, positions, meta)).split(lens)
    torch.testing.assert_close(rows[0], hf_logits(gpt_oss_dir, fresh), atol=1e-4, rtol=0)
    torch.testing.assert_close(rows[1], hf_logits(gpt_oss_dir, long)[25:], atol=1e-4, rtol=0)
    torch.testing.assert_close(rows[2], hf_logits(gpt_oss_dir, short)[4:], atol=1e-4, rtol=0)


def test_the_sinks_and_the_window_change_the_logits(gpt_oss_dir, eager_pipeline, hf_logits):
    """Guards the oracle: without sinks, or with every layer full, the logits leave transformers'."""
    want = hf_logits(gpt_oss_dir, PROMPTS[2])
    pipe = eager_pipeline(gpt_oss_dir)
    attns = [layer.self_attn for layer in pipe.stages[0].layers]
    assert [a.window for a in attns] == [8, None, 8]
    sinks = [a.sinks.detach().clone() for a in attns]
    for a in attns:
        a.sinks.data.fill_(float("-inf"))
    assert (pipe.prefill_logits(PROMPTS[2]) - want).abs().max() > 1e-2
    for a, s in zip(attns, sinks):
        a.sinks.data.copy_(s)
        a.window = None
    assert (pipe.prefill_logits(PROMPTS[2])[8:] - want[8:]).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
])
def test_yarn_tables_equal_transformers(rope):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = tf.Qwen3Config(hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=131072,
                            rope_parameters=dict(rope))
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    params = rope_parameters(config)
    assert torch.equal(rope_inv_freq(64, params), want_inv)
    assert rope_attention_scaling(params) == pytest.approx(want_scale, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize("pp_size,decode_graph", [(1, False), (2, False), (1, True)])
def test_engine_greedy_matches_hf(gpt_oss_dir, hf_greedy, pp_size, decode_graph):
    """Through the engine: batched prompts in chunks of 32 rows, then one that hits the prefix cache
    (the window layers' masks over cached blocks), decode rows of several sequences in one step;
    with decode graphs too (attention a graph break on the live metadata)."""
    from stagewise import LLM, SamplingParams
    shared = [(7 * i) % 800 + 5 for i in range(40)]
    prompts = [shared + [11, 12, 13], list(range(10, 31)), [5], shared + [99]]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(model=str(gpt_oss_dir), pp_size=pp_size, chunked_prefill_size=32, enable_prefix_caching=True,
             dtype="float32", prefill_graph="off", decode_graph=decode_graph) as llm:
        first = llm.generate(prompt_token_ids=prompts[:3], sampling_params=greedy, use_tqdm=False)
        second = llm.generate(prompt_token_ids=prompts[3:], sampling_params=greedy, use_tqdm=False)
    assert second[0].num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in first + second] == hf_greedy(gpt_oss_dir, prompts, 10)


def _gguf_tensors(hf_dir, mxfp4: bool) -> tuple[dict, dict]:
    """The checkpoint as llama.cpp's gpt-oss converter writes it (gate/up de-interleaved, experts
    stacked `[E, rows, K]`, in MXFP4 when `mxfp4`), and the expert matrices the file holds, back in
    transformers' layout (for the reference checkpoint)."""
    import gguf
    from safetensors.torch import load_file
    mx = gguf.GGMLQuantizationType.MXFP4
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
             "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
             **{f"self_attn.{p}_proj.{s}": f"attn_{'output' if p == 'o' else p}.{s}" for p in "qkvo"
                for s in ("weight", "bias")}}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}

    def stored(name: str, w: torch.Tensor) -> torch.Tensor:
        """Write `w` `[E, rows, K]` as `name`; returns the values the file holds."""
        if not mxfp4:
            out[name] = w.contiguous().numpy()
            return w
        out[name] = (raw := gguf.quants.quantize(w.contiguous().numpy(), mx), mx)
        return torch.from_numpy(gguf.quants.dequantize(raw, mx))

    out: dict = {}
    held: dict = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if name in top:
            out[top[name]] = t.numpy()
        elif rest in block:
            out[f"blk.{layer}.{block[rest]}"] = t.numpy()
        elif rest == "mlp.experts.gate_up_proj":       # [E, H, 2I], gate/up interleaved -> [E, I, H] each
            gate = stored(f"blk.{layer}.ffn_gate_exps.weight", t[:, :, ::2].transpose(1, 2))
            up = stored(f"blk.{layer}.ffn_up_exps.weight", t[:, :, 1::2].transpose(1, 2))
            held[name] = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], -1).flatten(-2)   # interleaved
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"blk.{layer}.ffn_gate_exps.bias"], out[f"blk.{layer}.ffn_up_exps.bias"] = (t[:, ::2].numpy(),
                                                                                          t[:, 1::2].numpy())
        elif rest == "mlp.experts.down_proj":           # [E, I, H] -> [E, H, I]
            held[name] = stored(f"blk.{layer}.ffn_down_exps.weight", t.transpose(1, 2)).transpose(1, 2)
        else:
            raise AssertionError(f"no GGUF name for {name}")
    return out, held


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gguf_file_matches_hf_on_its_values(gpt_oss_dir, gguf_tools, eager_pipeline, hf_logits, hf_greedy,
                                            tmp_path, mxfp4):
    """A `gpt-oss` GGUF file (experts F32 or MXFP4, held in their bytes and run by the MXFP4 kernels
    per routed expert) against transformers on the values the file holds, at PP=1 and PP=2."""
    from safetensors.torch import load_file, save_file

    from stagewise.model.gpt_oss import ExpertStack
    tensors, held = _gguf_tensors(gpt_oss_dir, mxfp4)
    path = gguf_tools.write_gguf(gpt_oss_dir, tmp_path / "tiny-gpt-oss.gguf", tensors=tensors)
    reference = tmp_path / "reference"
    reference.mkdir()
    for f in gpt_oss_dir.iterdir():
        if f.name != "model.safetensors":
            (reference / f.name).write_bytes(f.read_bytes())
    # a GGUF file stores no SwiGLU clamp: llama.cpp's graph fixes it at 7.0 (the test config's is 1.5)
    saved = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**saved, "swiglu_limit": 7.0}))
    weights = load_file(str(gpt_oss_dir / "model.safetensors"))
    save_file({**weights, **{k: v.contiguous() for k, v in held.items()}}, str(reference / "model.safetensors"))
    pipe = eager_pipeline(path)
    stacks = [m for m in pipe.stages[0].modules() if isinstance(m, ExpertStack)]
    assert len(stacks) == 9 and all((s.weight.dtype == torch.uint8) == mxfp4 for s in stacks)
    if mxfp4:       # packed per expert into the kernels' panels: the file's 17 bytes per 32 weights
        assert all(s.exact and s.weight.numel() == s.shape[0] * s.shape[1] * s.shape[2] // 32 * 17 for s in stacks)
        from stagewise.kernels.report import kernel_report
        assert "gemm_mxfp4" in {k.family for k in kernel_report(pipe.stages[0])}
    for ids in PROMPTS:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    if mxfp4:       # the kernels' fast mode (8-bit activations per 32) on an expert: near, not equal
        experts = pipe.stages[0].layers[0].mlp.experts
        x = torch.randn(5, experts.gate_exps.shape[2], generator=torch.Generator().manual_seed(0))
        exact = [experts.expert(x, e) for e in range(8)]
        for s in stacks:
            s.exact = False
        for e in range(8):
            fast = experts.expert(x, e)
            assert not torch.equal(fast, exact[e])
            torch.testing.assert_close(fast, exact[e], atol=0.02 * exact[e].abs().max().item(), rtol=0)
        for s in stacks:
            s.exact = True
    assert eager_pipeline(path, pp_size=2).greedy(PROMPTS[2], 12) == hf_greedy(reference, PROMPTS[2:], 12)[0]


def test_mxfp4_values_equal_gguf_dequantizer():
    """Every byte pattern: scales across the whole E8M0 range (subnormal ones too), all 16 codes."""
    import gguf
    import numpy as np

    from stagewise.kernels.quant_formats import mxfp4_values
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(64, 17 * 4), dtype=np.uint8)
    raw[:, ::17] = np.arange(64 * 4, dtype=np.uint8).reshape(64, 4) % 255     # every scale but NaN's 255
    with np.errstate(over="ignore"):       # the largest scales times 6 overflow to inf, in both
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(mxfp4_values(torch.from_numpy(raw), 128).numpy(), want)


def test_the_plan_counts_mxfp4_experts_in_their_bytes(gpt_oss_dir, gguf_tools, tmp_path):
    from stagewise.model.loader import load_model
    from stagewise.model.quantized import weight_bytes
    from stagewise.parallel.partition import StageInfo
    from stagewise.planning.report import ModelBytes
    path = gguf_tools.write_gguf(gpt_oss_dir, tmp_path / "mx.gguf", tensors=_gguf_tensors(gpt_oss_dir, True)[0])
    layers = ModelBytes.measure(str(path), torch.float32, None, True).layers
    model = load_model(path, StageInfo.single(3), torch.float32)
    assert layers == tuple(weight_bytes(model.layers[i]) for i in range(3))
    experts_mx = 8 * 3 * 64 * 32 // 32 * 17            # gate, up [32, 64] and down [64, 32] per expert, 17 B / 32
    float_layer = ModelBytes.measure(str(gpt_oss_dir), torch.float32, None, True).layers[0]
    assert float_layer - layers[0] == 8 * 3 * 64 * 32 * 4 - experts_mx


def test_long_prompt_cut_by_the_mask_budget_matches_hf(gpt_oss_dir, eager_pipeline, hf_logits, monkeypatch):
    """Full-attention rows cut into runs of a few rows (a small budget) give the same logits."""
    from stagewise.model import sink_attention
    monkeypatch.setattr(sink_attention, "MASK_BUDGET", 4 * 50 * 3)      # 4 heads: 3 rows of 49 keys per call
    pipe = eager_pipeline(gpt_oss_dir)
    torch.testing.assert_close(pipe.prefill_logits(PROMPTS[2]), hf_logits(gpt_oss_dir, PROMPTS[2]), atol=1e-4, rtol=0)


def test_mxfp4_checkpoint_directory_matches_hf_on_its_values(gpt_oss_dir, eager_pipeline, hf_logits, hf_greedy,
                                                             tmp_path):
    """The released checkpoints' layout (`*_blocks` / `*_scales` and `quantization_config` mxfp4): the
    experts stay in their bytes (packed for the MXFP4 kernels, with transformers' values); transformers'
    own dequantizer gives the reference's float experts."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from stagewise.kernels.quant import dequantize
    from stagewise.model.gpt_oss import GptOssExperts
    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(gpt_oss_dir / "model.safetensors"))
    packed, floats = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, rows = weights[name].shape                   # transformers' [E, in, out]
        blocks = torch.randint(0, 256, (e, rows, k // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 126, (e, rows, k // 32), generator=gen, dtype=torch.uint8)
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        floats[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    mx_dir, reference = tmp_path / "mxfp4", tmp_path / "reference"
    for out, tensors in ((mx_dir, packed), (reference, floats)):
        out.mkdir()
        for f in gpt_oss_dir.iterdir():
            if f.name != "model.safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((mx_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx_dir / "config.json").write_text(json.dumps(config))
    pipe = eager_pipeline(mx_dir, pp_size=2)
    experts = [m for stage in pipe.stages for m in stage.modules() if isinstance(m, GptOssExperts)]
    assert len(experts) == 3 and all(m.mxfp4 and m.gate_up_proj_blocks.dtype == torch.uint8 for m in experts)
    for proj in ("gate_up_proj", "down_proj"):     # packed from the checkpoint's bytes: transformers' values
        name = f"model.layers.0.mlp.experts.{proj}"
        assert getattr(experts[0], f"{proj}_blocks").numel() == packed[f"{name}_blocks"].numel() * 17 // 16
        for e in range(floats[name].shape[0]):
            assert torch.equal(dequantize(experts[0].expert_weight(proj, e)), floats[name][e].T)
    for ids in PROMPTS:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(reference, ids), atol=1e-4, rtol=0)
    assert pipe.greedy(PROMPTS[2], 12) == hf_greedy(reference, PROMPTS[2:], 12)[0]


def test_tokenizer_from_a_file_with_yarn_metadata(gpt_oss_dir, gguf_tools, tmp_path):
    """transformers fails parsing gpt-oss's `rope.scaling.*` keys when it picks a tokenizer class from
    a file's config; the file's own vocabulary is read anyway (no --tokenizer needed)."""
    from transformers import AutoTokenizer

    from stagewise.checkpoint.files import load_tokenizer
    tensors = _gguf_tensors(gpt_oss_dir, False)[0]
    path = gguf_tools.write_gguf(gpt_oss_dir, tmp_path / "tiny-gpt-oss.gguf", tensors=tensors)
    ours, want = load_tokenizer(path), AutoTokenizer.from_pretrained(gpt_oss_dir)
    text = "The pipeline has four stages, ünïcode 123!"
    assert ours.encode(text) == want.encode(text, add_special_tokens=False) and ours.decode(ours.encode(text)) == text


def test_tensor_parallel_ranks_on_an_mxfp4_file(gpt_oss_dir, gguf_tools, eager_pipeline, tp_threads, tmp_path):
    """Two ranks on a GGUF file: each loads its q heads' sinks and biases from the file's tensors and
    holds every MXFP4 expert; together they give the one-process tokens."""
    tensors = _gguf_tensors(gpt_oss_dir, True)[0]
    path = gguf_tools.write_gguf(gpt_oss_dir, tmp_path / "tiny-gpt-oss.gguf", tensors=tensors)
    want = eager_pipeline(path).greedy(PROMPTS[1], 12)
    pipes = tp_threads.sharded(path, 2)
    assert [p.stages[0].layers[0].self_attn.sinks.shape[0] for p in pipes] == [2, 2]
    assert tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPTS[1], 12)) == [want, want]


def test_one_row_runs_its_experts_in_one_call_with_the_batch_bits(gpt_oss_dir, gguf_tools, eager_pipeline, tmp_path):
    """Batch-1 decode on MXFP4 experts: every chosen expert's gate and up in one kernel call, the
    same bits as the row computed among others."""
    from stagewise.model.gpt_oss import GptOssMoE
    tensors = _gguf_tensors(gpt_oss_dir, True)[0]
    pipe = eager_pipeline(gguf_tools.write_gguf(gpt_oss_dir, tmp_path / "tiny-gpt-oss.gguf", tensors=tensors))
    moe = next(m for m in pipe.stages[0].modules() if isinstance(m, GptOssMoE))
    x = torch.randn(3, moe.router.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = moe(x)
        for i in range(3):
            assert torch.equal(moe(x[i:i + 1]), together[i:i + 1])
