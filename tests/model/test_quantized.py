"""Quantized weights held in their own bytes: GGUF files mixing every kernel type (K-quants as random
valid blocks, the 32-blocks quantized by gguf-py) run exactly as the same file dequantized to F32 and
as transformers' GGUF loader with `--dtype float32`; stages hold the file's share of bytes; PP=2 and
the compiled path equal the one-stage eager run; `--quantization int8|int4` round-trips a float
checkpoint; speculative verify rows, structured outputs and prompt logprobs work on quantized layers.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.cli import main
from stagewise.kernels import quant
from stagewise.model.loader import load_model, stage_skeleton
from stagewise.model.quantized import QuantEmbedding, QuantLinear, weight_bytes
from stagewise.parallel.partition import StageInfo, stage_infos

Q = gguf.GGMLQuantizationType
PROMPT = [5, 17, 300, 42, 9, 77, 512, 3, 250, 11, 600, 7]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# GGUF tensor kind -> type (ffn_down: one per layer), as llama.cpp's mixes pick them
MIXES = {
    "k_mix": dict(token_embd="Q4_K", attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K",
                  ffn_gate="Q4_K", ffn_up="Q5_K", ffn_down=("Q6_K", "Q4_K"), output="Q6_K"),
    "legacy_mix": dict(token_embd="Q8_0", attn_q="Q4_0", attn_k="Q4_1", attn_v="Q5_0", attn_output="Q5_1",
                       ffn_gate="Q8_0", ffn_up="Q4_0", ffn_down=("Q5_1", "Q4_1"), output="Q4_1"),
    "no_kernel": dict(ffn_down=("Q3_K", "Q2_K")),       # types without a kernel: dequantized at load
}


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path_factory):
    """Tokenizers converted from these throwaway files go to a temp cache; built kernels and compiled
    graphs are shared with the real cache (building them again costs a minute on 2 cores)."""
    from stagewise import envs
    private = tmp_path_factory.getbasetemp() / "stagewise-cache"
    for shared in ("kernels", "inductor"):
        (envs.STAGEWISE_CACHE / shared).mkdir(parents=True, exist_ok=True)
        if not (private / shared).exists():
            private.mkdir(exist_ok=True)
            (private / shared).symlink_to(envs.STAGEWISE_CACHE / shared, target_is_directory=True)
    monkeypatch.setenv("STAGEWISE_CACHE", str(private))


@pytest.fixture(scope="session")
def wide_llama_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A llama checkpoint with K a multiple of 256 (K-quant blocks): hidden 256, 2 layers, GQA."""
    import shutil

    import transformers as tf
    config = tf.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("wide-llama")
    tf.LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_tokenizer_dir / name, out / name)
    return out


# where each K-quant block keeps its fp16 super-block scale (and min), per ggml-common.h
_SUPER_SCALES = {Q.Q4_K: [slice(0, 2), slice(2, 4)], Q.Q5_K: [slice(0, 2), slice(2, 4)], Q.Q6_K: [slice(208, 210)],
                 Q.Q2_K: [slice(80, 82), slice(82, 84)], Q.Q3_K: [slice(108, 110)]}


def random_blocks(shape: tuple[int, ...], qtype, rng: np.random.Generator, std: float = 0.2) -> np.ndarray:
    """Random bytes as `qtype` blocks, with the fp16 super-block scales set so the values have `std`."""
    raw = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    scales = _SUPER_SCALES[qtype]
    for where in scales:
        blocks[:, where] = rng.uniform(0.5, 1.5, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    spread = gguf.quants.dequantize(raw, qtype).std()
    for where in scales:
        blocks[:, where] = (blocks[:, where].copy().view(np.float16) * (std / spread)).astype(np.float16).view(np.uint8)
    return raw


def _kind_type(name: str, mix: dict) -> str:
    parts = name.split(".")
    kind = parts[2] if parts[0] == "blk" else parts[0]
    pick = mix.get(kind, "F32")
    return pick[int(parts[1])] if isinstance(pick, tuple) else pick


@pytest.fixture(scope="session")
def mixed_gguf(wide_llama_dir, tmp_path_factory, gguf_tools):
    """Factory: `mixed_gguf(mix)` -> (quantized file, the same values as an F32 file)."""
    from transformers import AutoConfig
    made: dict[str, tuple[Path, Path]] = {}

    def make(mix: str) -> tuple[Path, Path]:
        if mix not in made:
            rng = np.random.default_rng(len(made))
            config = AutoConfig.from_pretrained(wide_llama_dir)
            quantized, dequantized = {}, {}
            for name, array in gguf_tools.gguf_tensors(wide_llama_dir, config, "llama").items():
                qtype = Q[_kind_type(name, MIXES[mix])] if array.ndim == 2 else Q.F32
                if qtype == Q.F32:
                    quantized[name] = dequantized[name] = array
                    continue
                raw = (random_blocks(array.shape, qtype, rng) if qtype in _SUPER_SCALES
                       else gguf.quants.quantize(array, qtype))
                quantized[name] = (raw, qtype)
                dequantized[name] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
            out = tmp_path_factory.mktemp(f"gguf-{mix}")
            made[mix] = (gguf_tools.write_gguf(wide_llama_dir, out / f"{mix}.gguf", tensors=quantized),
                         gguf_tools.write_gguf(wide_llama_dir, out / f"{mix}.F32.gguf", tensors=dequantized))
        return made[mix]
    return make


def _transformers_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("mix", ["k_mix", "legacy_mix"])
def test_float32_runs_exactly_the_dequantized_file(mix, mixed_gguf, eager_pipeline):
    path, f32_path = mixed_gguf(mix)
    ours, reference = eager_pipeline(path), eager_pipeline(f32_path)
    assert torch.allclose(ours.prefill_logits(PROMPT), reference.prefill_logits(PROMPT), atol=1e-3, rtol=0)
    tokens = ours.greedy(PROMPT, 8)
    assert tokens == reference.greedy(PROMPT, 8) == _transformers_greedy(path, PROMPT, 8)
    assert eager_pipeline(path, pp_size=2).greedy(PROMPT, 8) == tokens


@pytest.mark.parametrize("mix", ["k_mix", "legacy_mix"])
def test_each_stage_holds_its_share_of_the_file(mix, mixed_gguf):
    path = mixed_gguf(mix)[0]
    tensors = gguf.GGUFReader(path).tensors
    for stage in stage_infos(2, 2):
        model = load_model(path, stage, torch.float32)
        assert not [n for n, p in model.named_parameters() if p.dim() > 1]        # no float matrix kept
        owned = [t for t in tensors if (t.name.startswith(f"blk.{stage.start}.")
                                        or (stage.is_first and t.name == "token_embd.weight")
                                        or (stage.is_last and t.name.startswith("output")))]
        share = sum(int(t.n_bytes) for t in owned)
        assert share <= weight_bytes(model) <= 1.15 * share, (weight_bytes(model), share)
    qkv = load_model(path, StageInfo.single(2), torch.float32).layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear)
    want = [Q.Q4_K, Q.Q6_K] if mix == "k_mix" else [Q.Q4_0, Q.Q4_1, Q.Q5_0]
    assert [s.qtype for s in qkv.segments] == want


def test_embedding_dequantizes_only_the_rows_it_gathers(mixed_gguf, monkeypatch):
    path, f32_path = mixed_gguf("k_mix")
    model = load_model(path, StageInfo.single(2), torch.float32)
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.segment0.dtype == torch.uint8
    monkeypatch.setattr(quant, "_dequantize", lambda *a: pytest.fail("the whole table was dequantized"))
    ids = torch.tensor([3, 999, 3, 0])
    want = load_model(f32_path, StageInfo.single(2), torch.float32).embed_tokens(ids)
    assert torch.equal(model.embed_tokens(ids), want)


def test_type_without_a_kernel_is_dequantized_with_one_log_line(mixed_gguf, eager_pipeline, caplog):
    path, f32_path = mixed_gguf("no_kernel")
    with caplog.at_level("WARNING", logger="stagewise.model"):
        got = eager_pipeline(path).prefill_logits(PROMPT)
    lines = [r.getMessage() for r in caplog.records if "no quantized kernel" in r.getMessage()]
    assert len(lines) == 1 and "Q2_K, Q3_K" in lines[0]
    assert torch.allclose(got, eager_pipeline(f32_path).prefill_logits(PROMPT), atol=1e-4, rtol=0)


def _file_values(hf_dir: Path, out: Path, qtype: str) -> Path:
    """The checkpoint with each matrix as the GGUF file stores it, `qtype` blocks along the file's rows
    (GPT-2's Conv1D weights are transposed in the file, so they are quantized transposed)."""
    from transformers import AutoModelForCausalLM
    model, kind = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), Q[qtype]
    roundtrip = lambda a: gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                conv = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
                param.copy_(torch.from_numpy(roundtrip(param.numpy().T).T if conv else roundtrip(param.numpy())))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family,qtype", [("gpt2", "Q8_0"), ("gpt2", "Q4_1"), ("mistral", "Q5_0"),
                                          ("llama_tied", "Q4_0")])
def test_every_family_runs_on_quantized_rows(family, qtype, tiny_gguf, eager_pipeline, hf_logits, request, tmp_path):
    want = hf_logits(_file_values(request.getfixturevalue(f"{family}_dir"), tmp_path / "ref", qtype), PROMPT)
    for pp in (1, 2):      # one stage: a tied head is the quantized embedding; two: its own quantized copy
        pipeline = eager_pipeline(tiny_gguf(family, qtype), pp_size=pp)
        assert not [n for m in pipeline.stages for n, p in m.named_parameters() if p.dim() > 1]
        assert torch.allclose(pipeline.prefill_logits(PROMPT), want, atol=1e-4, rtol=0), (family, pp)


def _quantized_reference(hf_dir: Path, out: Path, kind: str) -> Path:
    """The checkpoint with each matrix through gguf-py's quantizer and back, as `--quantization kind`
    stores it (embeddings and heads in Q8_0; int4 layers in Q4_1)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                qtype = Q.Q8_0 if kind == "int8" or "embed_tokens" in name or "lm_head" in name else Q.Q4_1
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), qtype), qtype)))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantization_of_a_float_checkpoint_round_trips(kind, llama_dir, tmp_path, hf_greedy):
    model = load_model(llama_dir, StageInfo.single(4), torch.float32, quantization=kind)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * 4 + 1 and isinstance(model.embed_tokens, QuantEmbedding)
    assert {s.qtype for m in linears[:-1] for s in m.segments} == {Q.Q8_0 if kind == "int8" else Q.Q4_1}
    bits = {"int8": 8.5, "int4": 5.0}[kind]
    float_model = load_model(llama_dir, StageInfo.single(4), torch.float32)
    stored = sum(p.numel() * (8.5 if "embed" in n or "lm_head" in n else bits) / 8
                 for n, p in float_model.named_parameters() if p.dim() == 2)
    norms = sum(p.numel() * 4 for p in model.parameters())
    assert stored <= weight_bytes(model) - norms <= 1.05 * stored
    want = hf_greedy(_quantized_reference(llama_dir, tmp_path / "ref", kind), [PROMPT], GREEDY.max_tokens)
    with LLM(model=str(llama_dir), quantization=kind, dtype="float32", prefill_graph="off") as llm:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY, use_tqdm=False)
    assert [out[0].outputs[0].token_ids] == want


def test_quantization_is_refused_for_a_gguf_file(mixed_gguf, capsys):
    path = mixed_gguf("legacy_mix")[0]
    with pytest.raises(ValueError, match=r"--quantization int8 quantizes float checkpoints at load, but .* is a GGUF "
                                         r"file whose tensors keep the types they are stored in; drop --quantization"):
        LLM(model=str(path), quantization="int8")
    assert main(["--log-level", "ERROR", "generate", "--model", str(path), "--quantization", "int4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quantization int4") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("mix", ["k_mix", "legacy_mix"])
def test_tensor_parallel_ranks_split_quantized_layers(mix, mixed_gguf, eager_pipeline, tp_threads, capsys):
    """Two ranks (threads) of a GGUF file in float32 give the one-process logits and tokens, bit for
    bit: every quantized matrix splits by rows (whole rows of blocks), so every tensor stays quantized
    (Q4_K's 256-wide blocks included, which a split by columns could not keep)."""
    path = mixed_gguf(mix)[0]
    whole = eager_pipeline(path)
    pipes = tp_threads.sharded(path, 2)
    for got in tp_threads.on_ranks(2, lambda r: pipes[r].prefill_logits(PROMPT)):
        assert torch.equal(got, whole.prefill_logits(PROMPT))
    assert tp_threads.on_ranks(2, lambda r: pipes[r].greedy(PROMPT, 8)) == [whole.greedy(PROMPT, 8)] * 2
    for pipe in pipes:
        layer = pipe.stages[0].layers[0]
        assert isinstance(layer.mlp.down_proj, QuantLinear) and isinstance(pipe.stages[0].embed_tokens, QuantEmbedding)
        assert isinstance(layer.self_attn.o_proj, QuantLinear)
    assert main(["--log-level", "ERROR", "plan", "--model", str(path), "--tp-size", "2", "--pp-size", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:2] in ("0/", "1/")]
    assert [row[0] for row in rows] == ["0/0", "0/1", "1/0", "1/1"]


def test_off_the_cpu_a_gguf_file_is_dequantized_and_quantization_refused(mixed_gguf, llama_dir):
    """The quantized kernels are CPU kernels: on CUDA every layer is float (the skeleton is on meta)."""
    path, stage = mixed_gguf("legacy_mix")[0], StageInfo.single(2)
    held = lambda device: [m for m in stage_skeleton(path, stage, torch.bfloat16, exact=False, device=device).modules()
                           if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert held("cpu") and not held("cuda")
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU"):
        stage_skeleton(llama_dir, StageInfo.single(4), torch.bfloat16, quantization="int8", device="cuda")


def _features(path: Path, spec: dict | None) -> tuple:
    """Greedy tokens of a repetitive prompt (drafts get proposed), a constrained choice, prompt logprobs."""
    repetitive = [5, 6, 7, 8, 9] * 5
    with LLM(model=str(path), dtype="float32", prefill_graph="off", speculative_config=spec) as llm:
        tokens = llm.generate(prompt_token_ids=[repetitive, PROMPT], sampling_params=GREEDY, use_tqdm=False)
        choice = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
            max_tokens=10, temperature=0, structured_outputs={"choice": ["yes", "no", "maybe"]}))[0].outputs[0]
        scored = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        proposed = llm.stats().get("speculative", {}).get("proposed", 0)
    return ([o.outputs[0].token_ids for o in tokens], choice.text,
            torch.tensor([e.logprob for e in scored.prompt_logprobs[1:]]), proposed)


@pytest.mark.slow
def test_speculation_structured_outputs_and_prompt_logprobs_on_quantized_layers(mixed_gguf):
    path, f32_path = mixed_gguf("legacy_mix")
    tokens, choice, logprobs, proposed = _features(path, {"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1})
    want_tokens, want_choice, want_logprobs, _ = _features(f32_path, None)
    assert proposed > 0 and tokens == want_tokens
    assert choice == want_choice and choice in ("yes", "no", "maybe")
    assert torch.allclose(logprobs, want_logprobs, atol=1e-3)


@pytest.mark.slow
def test_compiled_and_two_stages_equal_eager_on_quantized_weights(mixed_gguf):
    path = mixed_gguf("k_mix")[0]
    prompts = [PROMPT, list(range(10, 41)), [5]]

    def run(**options) -> list[list[int]]:          # bfloat16 by name: the kernels' fast mode
        with LLM(model=str(path), chunked_prefill_size=16, dtype="bfloat16", **options) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
            graphs = llm.stats()["prefill_graph"]
        assert options["prefill_graph"] == "off" or (graphs["backend"] == "compiled" and not graphs["eager"])
        return [o.outputs[0].token_ids for o in outs]
    eager = run(prefill_graph="off")
    assert run(prefill_graph="compiled") == eager
    assert run(pp_size=2, prefill_graph="off") == eager


@pytest.mark.slow
def test_a_rebuilt_stage_reloads_its_quantized_layers(llama_dir):
    """SIGKILL a stage of an int4 pipeline mid-generate: the rebuilt stage quantizes its layers again
    and every output equals the fault-free run, not the float model's. (Exact mode: in the fast mode a
    recomputed prompt may round an activation the other way and take another near-tie token.)"""
    import os
    import signal
    import threading
    import time
    prompts, greedy = [[5 + i, 6, 7 + i, 8] for i in range(4)], SamplingParams(max_tokens=30, temperature=0,
                                                                               ignore_eos=True)
    with LLM(model=str(llama_dir), prefill_graph="off", dtype="float32") as llm:
        float_tokens = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy,
                                                                      use_tqdm=False)]
    with LLM(model=str(llama_dir), quantization="int4", pp_size=2, prefill_graph="off", dtype="float32",
             dist_timeout_s=30) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy,
                                                                  use_tqdm=False)]
        target, victim = llm.engine.stats_.num_steps + 10, llm.engine.executor.procs[1].pid

        def kill():
            while llm.engine.stats_.num_steps < target:
                time.sleep(0.002)
            os.kill(victim, signal.SIGKILL)
        threading.Thread(target=kill, daemon=True).start()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        assert llm.stats()["recovery"]["rebuilds"] == {"stage_died": 1}
    assert [o.outputs[0].token_ids for o in outs] == reference != float_tokens
