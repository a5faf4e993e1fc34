"""bfloat16 against HF transformers run in bfloat16 on the same weights.

bf16 rounds every op, so "equal to HF" needs a tolerance that bf16 itself sets: the noise of a
bf16 run is how far HF bf16 lands from HF fp32 on the same input. Our bf16 logits must sit well
inside that noise of HF bf16 (a model computing in fp32, or in a different op order with more
roundings, lands about a whole noise away and fails), and each greedy token we pick must be
HF bf16's own argmax up to that noise (at near-ties either token is a correct bf16 greedy pick).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from stagewise import LLM, SamplingParams
from stagewise.kernels import attention as cpu_attention
from stagewise.model import cpu_gemm as model_gemm
from stagewise.model import gpt2

PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9))]
INSIDE_NOISE = 0.75    # ours-vs-HF-bf16 distance as a fraction of HF bf16's own distance from fp32


@functools.lru_cache(maxsize=None)
def _hf(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_logits(model_dir, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        return _hf(str(model_dir), dtype)(torch.tensor([ids])).logits[0].float()   # [T, V]


def test_prefill_logits_sit_inside_bf16_noise_of_hf_bf16(family_dir, eager_pipeline, monkeypatch):
    """SDPA here, as in HF: the bf16 prefill attention kernel sums in another order (one bf16 ulp
    apart on an attention output, which the tiny random models amplify to about one noise); its
    own test holds it to SDPA's accuracy against float32."""
    monkeypatch.setattr(cpu_attention, "prefill_supports", lambda q, k: False)
    pipe = eager_pipeline(family_dir, dtype=torch.bfloat16)
    for ids in PROMPTS:
        ours = pipe.prefill_logits(ids).float()
        hf16, hf32 = hf_logits(family_dir, ids, torch.bfloat16), hf_logits(family_dir, ids, torch.float32)
        noise, err = (hf16 - hf32).abs().max(), (ours - hf16).abs().max()
        assert noise > 0, "HF bf16 equals fp32: the fixture cannot tell the precisions apart"
        assert err <= INSIDE_NOISE * noise, f"ours vs HF bf16 {err:.4f}, bf16 noise {noise:.4f}"
        top2 = hf16.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err        # positions whose argmax bf16 cannot flip
        assert torch.equal(ours.argmax(-1)[clear], hf16.argmax(-1)[clear])


def test_bf16_prefill_is_hf_bf16_bit_for_bit(family_dir, eager_pipeline, monkeypatch):
    """Every block rounds where HF's does (RMSNorm before its weight, rope in the activation
    dtype, GPT-2's gelu formula op by op), so a one-chunk prefill gives HF bf16's logits exactly.
    The GEMMs are torch's bf16 F.linear, as in HF: the small-row kernel sums in another order, and on
    CPUs without native bf16 the engine widens bf16 weights to float32 for MKL (their own tests
    bound both), so they are kept out here, and so are the packed weights and the bf16 prefill
    attention kernel (it rounds the probabilities where SDPA's math does not)."""
    monkeypatch.setattr(model_gemm, "linear", F.linear)     # Linear layers and the LM head
    monkeypatch.setattr(gpt2, "linear", F.linear)
    monkeypatch.setenv("STAGEWISE_PACKED_WEIGHTS", "0")
    monkeypatch.setattr(cpu_attention, "prefill_supports", lambda q, k: False)
    pipe = eager_pipeline(family_dir, dtype=torch.bfloat16)
    for ids in PROMPTS:
        assert torch.equal(pipe.prefill_logits(ids).float(), hf_logits(family_dir, ids, torch.bfloat16))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_engine_bf16_greedy_tokens_are_hf_bf16_argmaxes(family, tiny_model_dirs):
    """Batched decode through the engine in bf16; every token is checked against HF bf16 on the
    sequence the engine produced (teacher forcing, so one near-tie does not derail the rest)."""
    model_dir = tiny_model_dirs[family]
    with LLM(model=str(model_dir), dtype="bfloat16", kv_cache_memory="16MiB") as llm:
        assert llm.engine.executor.worker.model.dtype == torch.bfloat16
        outs = llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False,
                            sampling_params=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        got = out.outputs[0].token_ids
        seq = ids + got[:-1]
        hf16, hf32 = (hf_logits(model_dir, seq, d)[len(ids) - 1:] for d in (torch.bfloat16, torch.float32))
        noise = (hf16 - hf32).abs().max()
        chosen = hf16.gather(1, torch.tensor(got)[:, None])[:, 0]         # HF bf16 logit of our token
        assert (hf16.amax(-1) - chosen).max() <= 2 * noise, (got, hf16.argmax(-1).tolist())
