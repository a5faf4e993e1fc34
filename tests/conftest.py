"""Shared fixtures: tiny local HF checkpoints for every supported family, the HF reference helpers
(`hf_greedy`, `hf_logits`) and an eager multi-stage driver (`eager_pipeline`) for tests.

Checkpoints are made with the HF classes from seeded weights re-drawn with a large std (0.2), so
logits are well separated and greedy decoding has no near-ties; nothing is downloaded.
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 1000
FAMILIES = ("llama", "llama_tied", "mistral", "qwen2", "qwen3", "gpt2")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe")    # tests/model/test_moe.py
DENSE_FAMILIES = ("smollm3", "olmo2", "granite", "phi3", "phi4_mini", "gemma3")    # tests/model/test_dense_families.py
# Tiny tensors gain nothing from intra-op threads, and on a busy 2-core box OpenMP spinning makes
# them ~8x slower; one thread keeps the suite fast (spawned worker processes choose their own).
torch.set_num_threads(1)

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _family_config(family: str, vocab: int):
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
                  num_attention_heads=4, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "llama":  # GQA, untied head, llama3 rope scaling that touches every frequency band
        return tf.LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE, **common)
    if family == "llama_tied":  # MHA, tied head, attention + MLP biases, 3 layers (uneven splits)
        return tf.LlamaConfig(num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=True,
                              attention_bias=True, mlp_bias=True, **common)
    if family == "mistral":  # explicit head_dim larger than hidden / heads
        return tf.MistralConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, sliding_window=None,
                                **common)
    if family == "llama_mqa":  # one KV head: fewer than tensor-parallel ranks (not in FAMILIES)
        return tf.LlamaConfig(num_hidden_layers=4, num_key_value_heads=1, **common)
    if family == "llama_uneven":  # 9 q heads in 3 KV groups, tied head (the default model's shape): uneven TP
        return tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=3, tie_word_embeddings=True,
                              **{**common, "num_attention_heads": 9, "hidden_size": 144})
    if family == "llama_uneven_mqa":  # 3 q heads, 1 KV head: over 2 ranks the KV head is replicated, 1 + 2 q heads
        return tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=1,
                              **{**common, "num_attention_heads": 3, "hidden_size": 48})
    if family == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=4, num_key_value_heads=2, **common)
    if family == "qwen2_tied":  # tied head, as Qwen2.5's small models (not in FAMILIES)
        return tf.Qwen2Config(num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if family == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, **common)
    moe = dict(num_key_value_heads=2, num_experts_per_tok=2, **common)
    if family == "qwen3_moe":  # 8 experts top-2 renormalised; layer 1 dense (mlp_only_layers)
        return tf.Qwen3MoeConfig(num_hidden_layers=3, head_dim=16, num_experts=8, moe_intermediate_size=32,
                                 norm_topk_prob=True, mlp_only_layers=[1], **moe)
    if family == "qwen3_moe_768":  # the expert size transformers' GGUF loader assumes (it reads no expert size)
        return tf.Qwen3MoeConfig(num_hidden_layers=2, head_dim=16, num_experts=8, moe_intermediate_size=768,
                                 norm_topk_prob=True, **moe)
    if family == "mixtral":
        return tf.MixtralConfig(num_hidden_layers=2, num_local_experts=8, sliding_window=None,
                                **{**moe, "intermediate_size": 64})
    if family == "qwen2_moe":  # a shared expert and its sigmoid gate; top-k weights not renormalised
        return tf.Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, **moe)
    if family == "olmoe":  # q/k norms over the whole projections, q/k/v clamped
        return tf.OlmoeConfig(num_hidden_layers=2, num_experts=8, clip_qkv=2.0, **{**moe, "intermediate_size": 32})
    if family == "smollm3":  # layers 1 and 3 without rope (NoPE), tied head as the released models
        return tf.SmolLM3Config(num_hidden_layers=4, num_key_value_heads=2, no_rope_layers=[1, 0, 1, 0], **common)
    if family == "smollm3_nope4":  # the released models' rule (every 4th layer without rope), as GGUF files hold
        return tf.SmolLM3Config(num_hidden_layers=4, num_key_value_heads=2, **common)
    if family == "olmo2":  # norms after attention and MLP, q/k norms over the whole projections
        return tf.Olmo2Config(num_hidden_layers=3, num_key_value_heads=2, **common)
    if family == "granite":  # every multiplier away from 1
        return tf.GraniteConfig(num_hidden_layers=3, num_key_value_heads=2, embedding_multiplier=3.0,
                                attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0, **common)
    if family in ("phi3", "phi3_short"):  # long-rope past 32 positions (the long factors, cos/sin scaled) or
        # within them (the short factors)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 2.0 * i for i in range(8)]}
        return tf.Phi3Config(num_hidden_layers=3, num_key_value_heads=2, original_max_position_embeddings=32,
                             rope_parameters=rope, sliding_window=None,
                             **{**common, "max_position_embeddings": 512 if family == "phi3" else 32})
    if family == "phi4_mini":  # partial rotary (half of each head), tied head, as Phi-4-mini
        return tf.Phi3Config(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True,
                             rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                             sliding_window=None, **common)
    if family in ("gemma3", "gemma3_hd"):  # 6 layers: 5 window layers (window 8) then a global one; soft-capped
        # logits; `gemma3_hd`: softmax scale 1/sqrt(head size), as the released 1B-12B (and GGUF files) have it
        return tf.Gemma3TextConfig(num_hidden_layers=6, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                   query_pre_attn_scalar=24 if family == "gemma3" else 16, final_logit_softcapping=30.0,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 100000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}},
                                   **common)
    if family == "gpt_oss":  # sliding (window 8) / full / sliding layers, YaRN that moves every band, tight clamps
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}
        return tf.GptOssConfig(num_hidden_layers=3, head_dim=16, num_local_experts=8, sliding_window=8,
                               swiglu_limit=1.5, rope_parameters=yarn, **{**moe, "intermediate_size": 32})
    if family == "qwen3_5":  # linear / linear / linear / full attention; 4 value heads over 2 key heads
        return tf.Qwen3_5TextConfig(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                    **common)
    if family == "qwen3_next":  # Qwen3.5's kinds, qkvz/ba projections per key head; MoE (8 experts, top-2,
        # renormalised, a shared expert) on layers 0, 2 and 3 (layer 1 dense: mlp_only_layers)
        return tf.Qwen3NextConfig(num_hidden_layers=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                                  linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, mlp_only_layers=[1], **common)
    if family == "gpt2_3h":  # 3 heads: 1 + 2 over two ranks
        return tf.GPT2Config(vocab_size=vocab, n_embd=48, n_layer=2, n_head=3, n_inner=128, n_positions=512,
                             bos_token_id=0, eos_token_id=1)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=4, n_head=4, n_inner=128, n_positions=512,
                             bos_token_id=0, eos_token_id=1)
    raise ValueError(family)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with std 0.2 (norm scales 1 +- 0.1): HF's 0.02 init gives near-uniform logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_scale = param.dim() == 1 and name.endswith("weight")  # RMSNorm / LayerNorm scales
            param.copy_(1.0 + 0.1 * noise if is_scale else (0.1 if param.dim() == 1 else 0.2) * noise)


def build_tiny_checkpoint(out_dir: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    import transformers as tf
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = _family_config(family, vocab)
    cls = (tf.GPT2LMHeadModel if family.startswith("gpt2") else tf.Gemma3ForCausalLM if family.startswith("gemma3")
           else tf.Qwen3_5ForCausalLM if family == "qwen3_5"
           else getattr(tf, type(config).__name__.replace("Config", "ForCausalLM")))
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    _redraw(model, seed)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from stagewise.model.demo import build_test_tokenizer
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_test_tokenizer(path, TINY_VOCAB, max_length=512)
    return path


def _family_fixture(family: str):
    @pytest.fixture(scope="session")
    def _dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
        return build_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{family}"), family, tiny_tokenizer_dir)
    return _dir


llama_dir = _family_fixture("llama")
llama_tied_dir = _family_fixture("llama_tied")
mistral_dir = _family_fixture("mistral")
qwen2_dir = _family_fixture("qwen2")
qwen3_dir = _family_fixture("qwen3")
gpt2_dir = _family_fixture("gpt2")
llama_mqa_dir = _family_fixture("llama_mqa")
llama_uneven_dir = _family_fixture("llama_uneven")
llama_uneven_mqa_dir = _family_fixture("llama_uneven_mqa")
gpt2_3h_dir = _family_fixture("gpt2_3h")
qwen2_tied_dir = _family_fixture("qwen2_tied")
qwen3_moe_dir = _family_fixture("qwen3_moe")
qwen3_moe_768_dir = _family_fixture("qwen3_moe_768")
mixtral_dir = _family_fixture("mixtral")
qwen2_moe_dir = _family_fixture("qwen2_moe")
olmoe_dir = _family_fixture("olmoe")
smollm3_dir = _family_fixture("smollm3")
olmo2_dir = _family_fixture("olmo2")
smollm3_nope4_dir = _family_fixture("smollm3_nope4")
granite_dir = _family_fixture("granite")
phi3_dir = _family_fixture("phi3")
phi3_short_dir = _family_fixture("phi3_short")
phi4_mini_dir = _family_fixture("phi4_mini")
gemma3_dir = _family_fixture("gemma3")
gemma3_hd_dir = _family_fixture("gemma3_hd")
gpt_oss_dir = _family_fixture("gpt_oss")
qwen3_5_dir = _family_fixture("qwen3_5")
qwen3_next_dir = _family_fixture("qwen3_next")


@pytest.fixture(scope="session")
def tiny_model_dirs(request) -> dict[str, Path]:
    """All tiny checkpoints by family name."""
    return {family: request.getfixturevalue(f"{family}_dir") for family in FAMILIES}


@pytest.fixture(scope="session", params=FAMILIES)
def family_dir(request) -> Path:
    """Each tiny checkpoint in turn (only the requested ones get built)."""
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def sharded_llama_dir(tmp_path_factory, llama_dir) -> Path:
    """The `llama_dir` weights saved in ~100 KB shards (model.safetensors.index.json + shards)."""
    from transformers import AutoModelForCausalLM
    path = tmp_path_factory.mktemp("tiny-llama-sharded")
    AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).save_pretrained(path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(llama_dir / name, path / name)
    return path


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # NOTE: clear eos so generate always yields max_new_tokens (eos_token_id=None as a generate
    # argument does not override it in transformers 5; min_new_tokens would mask eos and change argmaxes).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model_dir, prompt_ids_list: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate` greedy continuations (new tokens only), one prompt at a time, never stopped by eos."""
    model, outs = _hf_model(str(model_dir)), []
    for ids in prompt_ids_list:
        inp = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                 max_new_tokens=max_new_tokens)
        outs.append(out[0, len(ids):].tolist())
        assert len(outs[-1]) == max_new_tokens
    return outs


def hf_logits(model_dir, ids: list[int], inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """HF float32 logits `[T, V]` for one prompt (or for `inputs_embeds [T, H]`)."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        if inputs_embeds is not None:
            return model(inputs_embeds=inputs_embeds[None]).logits[0].float()
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="session", name="hf_greedy")
def hf_greedy_fixture():
    return hf_greedy


@pytest.fixture(scope="session", name="hf_logits")
def hf_logits_fixture():
    return hf_logits


class EagerPipeline:
    """Reference driver for tests: every stage of a checkpoint in this process, run in order, eager.

    Up to 4 sequences get disjoint block ranges of a paged KV cache (`block_size` 16, 256 tokens
    each with the default 64 blocks); `reset()` zeroes it. `tp` (rank, size): that tensor-parallel
    rank's slices of every stage (parallel/tp.py; connect them to a group before running);
    `quantization`: int8 | int4 at load.
    """

    def __init__(self, model_dir, pp_size: int = 1, partition=None, num_blocks: int = 64, dtype=torch.float32,
                 tp=None, quantization=None):
        from stagewise.checkpoint.facts import read_facts
        from stagewise.kvcache.state import StatePool
        from stagewise.model.attention import ForwardBatch
        from stagewise.model.loader import load_model
        from stagewise.parallel.partition import stage_infos
        num_layers = read_facts(model_dir).num_layers
        self.block_size, self.num_blocks = 16, num_blocks
        infos = stage_infos(num_layers, pp_size, partition)
        self.stages = [load_model(model_dir, info, dtype, tp=tp, quantization=quantization) for info in infos]
        self.batches = []
        for model in self.stages:
            hkv, d = model.kv_cache_spec()
            caches = [torch.zeros(2, num_blocks, self.block_size, hkv, d, dtype=dtype) if model.stage.owns(i)
                      else None for i in range(num_layers)]
            # recurrent layers (linear attention): a state slot per sequence slot (kvcache/state.py)
            spec = getattr(model, "state_spec", dict)()
            states = StatePool(spec, num_layers, 4).layers if spec else None
            self.batches.append(ForwardBatch(None, caches, states))

    def reset(self) -> None:
        for batch in self.batches:
            for cache in batch.kv_caches:
                if cache is not None:
                    cache.zero_()

    def forward(self, ids, positions, meta, input_embeds=None) -> torch.Tensor:
        """Run all stages; returns the last stage's hidden states `[T, H]`."""
        out = None
        if meta.state_slots is None:        # sequence i in state slot i, as in block range i
            meta.state_slots = list(range(len(meta.query_lens)))
        for model, batch in zip(self.stages, self.batches):
            batch.meta = meta
            first = model.stage.is_first
            out = model(ids if first and input_embeds is None else None, positions, batch,
                        input_embeds=input_embeds if first else None, pp_proxy_tensors=None if first else out)
        return out

    def table(self, seq: int) -> list[int]:
        """Block table of sequence slot `seq` (up to 4 slots, num_blocks // 4 blocks each)."""
        per_seq = self.num_blocks // 4
        return list(range(seq * per_seq, (seq + 1) * per_seq))

    def prefill_logits(self, ids: list[int], input_embeds=None) -> torch.Tensor:
        """Logits `[T, V]` for one fresh prompt."""
        from stagewise.model.attention import AttentionMetadata
        self.reset()
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [self.table(0)], self.block_size)
        hidden = self.forward(torch.tensor(ids), torch.arange(len(ids)), meta, input_embeds)
        return self.stages[-1].compute_logits(hidden)

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Prefill then one-token decode steps, metadata rebuilt each step."""
        from stagewise.model.attention import AttentionMetadata
        logits = self.prefill_logits(ids)
        out = [int(logits[-1].argmax())]
        for step in range(max_new_tokens - 1):
            seq_len = len(ids) + step + 1
            meta = AttentionMetadata.build([1], [seq_len], [self.table(0)], self.block_size)
            hidden = self.forward(torch.tensor(out[-1:]), torch.tensor([seq_len - 1]), meta)
            out.append(int(self.stages[-1].compute_logits(hidden)[-1].argmax()))
        return out


@pytest.fixture(scope="session")
def eager_pipeline():
    """Factory: `eager_pipeline(model_dir, pp_size=1, partition=None)` -> EagerPipeline."""
    return EagerPipeline


class TensorParallelThreads:
    """Tensor-parallel ranks as threads of this process, joined by the shared-memory collectives.
    One per test: `close()` detaches every group it opened (a process holds at most 64)."""

    def __init__(self) -> None:
        self.opened: list = []

    def groups(self, size: int) -> list:
        import os
        import uuid

        from stagewise.kernels import comm
        path = os.path.join(comm.shm_dir(), f"stagewise-test-{uuid.uuid4().hex}")
        comm.create(path, size, 1 << 20)
        try:
            made = [comm.ShmGroup(path, r, size, timeout_s=30.0) for r in range(size)]
        finally:
            os.unlink(path)
        self.opened += made
        return made

    def close(self) -> None:
        for group in self.opened:
            group.close()
        self.opened.clear()

    @staticmethod
    def on_ranks(size: int, fn) -> list:
        """fn(rank) on `size` threads at once (the ranks); their results in rank order."""
        import threading
        out: list = [None] * size
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                with torch.inference_mode():
                    out[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001  (re-raised below)
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def sharded(self, model_dir, size: int, pp_size: int = 1, quantization=None) -> list[EagerPipeline]:
        """Each rank's EagerPipeline, every stage connected to its group (every rank gathers the logits)."""
        from stagewise.parallel import tp
        pipes = [EagerPipeline(model_dir, pp_size=pp_size, tp=(r, size), quantization=quantization)
                 for r in range(size)]
        for stage in range(pp_size):
            for pipe, group in zip(pipes, self.groups(size)):
                tp.connect(pipe.stages[stage], group, logits_to=-1)
        return pipes


@pytest.fixture
def tp_threads():
    """`TensorParallelThreads`: groups(size), on_ranks(size, fn), sharded(model_dir, size, pp_size=1); the
    groups it opened are closed after the test."""
    threads = TensorParallelThreads()
    yield threads
    threads.close()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="the release run of tests/battery/ (16 clients for minutes, every attack, the "
                          "default grammar budgets) instead of CI's short one")
