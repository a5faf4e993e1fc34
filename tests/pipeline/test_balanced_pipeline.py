"""Balanced pipelines end to end: the `auto` partition (driver and stage processes agree, and it
runs token for token like the explicit split), dynamic chunking with its real start-up profile
(greedy-equal to fixed chunks at PP=1 and PP=2, every chunk within the step budget), and the
balance statistics. The model has a heavy head (vocab 4096, hidden 64, 6 layers), so `auto`
differs from the even split."""
import pytest
import transformers as tf

from stagewise import LLM, SamplingParams
from stagewise.engine.balance import ChunkCosts, DynamicChunkSizer

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i) % 900 + 3 for i in range(150)], list(range(10, 15)), [(11 * i) % 800 + 5 for i in range(97)],
           list(range(200, 240))]
OPTS = dict(chunked_prefill_size=32, block_size=4, enable_prefix_caching=False)
AUTO_SPLIT = (5, 1)


@pytest.fixture(scope="module")
def heavy_dir(tmp_path_factory, tiny_tokenizer_dir):
    import torch
    path = tmp_path_factory.mktemp("heavy-head")
    config = tf.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if param.dim() == 1 else 0.2 * noise)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((tiny_tokenizer_dir / name).read_bytes())
    return path


class ChunkSpy:
    """Wraps a chunker and records every (start, remaining, budget, chosen length)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def chunk_len(self, start, remaining, budget):
        n = self.inner.chunk_len(start, remaining, budget)
        self.calls.append((start, remaining, budget, n))
        return n


def _generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                         use_tqdm=False)]


def _strong_sizer():
    """Chunks shrink fast with the prefix: 32 tokens at 0, 8 after ~100."""
    return ChunkSpy(DynamicChunkSizer(ChunkCosts(0.0, 1e-6, 1e-7), base=32, align=4))


def _check_chunks(spy, budget=32):
    prefill = [c for c in spy.calls if c[1] > 1]
    assert prefill and all(n <= b <= budget for _, _, b, n in prefill)
    assert any(n < min(r, b) for _, r, b, n in prefill)          # some later chunk really was shrunk


@pytest.fixture(scope="module")
def fixed_ref(heavy_dir):
    with LLM(model=str(heavy_dir), **OPTS) as llm:
        return _generate(llm)


def test_dynamic_chunking_at_pp1_equals_fixed_chunks(heavy_dir, fixed_ref):
    with LLM(model=str(heavy_dir), enable_dynamic_chunking=True, **OPTS) as llm:
        assert type(llm.engine.scheduler.chunker).__name__ == "DynamicChunkSizer"     # the profile ran
        assert _generate(llm) == fixed_ref
        llm.engine.scheduler.chunker = spy = _strong_sizer()
        assert _generate(llm) == fixed_ref
    _check_chunks(spy)


def test_auto_partition_with_dynamic_chunks_at_pp2(heavy_dir, fixed_ref):
    with LLM(model=str(heavy_dir), pp_size=2, enable_dynamic_chunking=True, **OPTS) as llm:
        assert llm.engine.resolved.partition == AUTO_SPLIT
        assert llm.engine.config.parallel.pp_layer_partition == "auto"      # the user's config is left as asked
        assert [p.layers for p in llm.engine.executor.memory_plans] == [(0, 5), (5, 6)]   # the stages agree
        llm.engine.scheduler.chunker = spy = _strong_sizer()
        assert _generate(llm) == fixed_ref
        stats = llm.stats()
    _check_chunks(spy)
    assert len(stats["stage_bubble_fraction"]) == 2 and all(0 <= b <= 1 for b in stats["stage_bubble_fraction"])
    assert stats["stage_predicted_share"] == pytest.approx([0.5, 0.5], abs=0.05)
    assert sum(stats["stage_measured_share"]) == pytest.approx(1.0)
    assert stats["pipeline_active_s"] > 0


def test_explicit_partition_equals_auto_token_for_token(heavy_dir, fixed_ref):
    with LLM(model=str(heavy_dir), pp_size=2, pp_layer_partition=",".join(map(str, AUTO_SPLIT)), **OPTS) as llm:
        assert llm.engine.resolved.partition == llm.engine.config.parallel.pp_layer_partition == AUTO_SPLIT
        assert _generate(llm) == fixed_ref
