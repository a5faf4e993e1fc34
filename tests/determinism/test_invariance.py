"""Which ways of splitting the work give the same greedy tokens and logprob bits (docs/determinism.md).

The same six mixed-length prompts (token ids, seeded) run greedy with logprobs under two splits of
the work, and the two runs are compared exactly (token ids, and logprob floats with `==`).

Both modes: the same run twice, alone vs in a batch, and the prefix cache cold vs off are
identical. With `invariant_attention=True` (every prefill and verify row through the per-row
kernel, model/attention.py `invariant_paged_attention`) so are chunk sizes 512 vs 16 vs 7, the
prefix cache cold vs warm, a prompt whose prefill spans two steps and n-gram speculation on vs
off, in float32 and bfloat16. In the default mode those splits move logprob bits (float32 keeps
the ids) and in bfloat16 can change ids: asserted as before, and one case shows the bit check
catches it.
"""
from __future__ import annotations

import random

import pytest

from stagewise import LLM, SamplingParams
from stagewise.kernels import attention as cpu_attention

LENGTHS = (3, 9, 24, 57, 101, 190)     # 384 tokens together: one step at chunked_prefill_size 512
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Six prompts of LENGTHS (half of them a repeated 5-token pattern, for the n-gram proposer) and
    six other prompts of random lengths, to fill a batch of 12."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        pattern = [rng.randrange(3, 990) for _ in range(5)]
        if rng.random() < 0.5:
            return [pattern[i % 5] for i in range(n)]
        return [rng.randrange(3, 990) for _ in range(n)]
    return [prompt(n) for n in LENGTHS], [prompt(rng.randrange(2, 160)) for _ in range(6)]


PROMPTS, OTHERS = _prompts(45)


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """(token ids, logprob of each chosen token) per prompt."""
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def alone(llm: LLM) -> list[tuple[list[int], list[float]]]:
    return [run(llm, [p])[0] for p in PROMPTS]


def first_difference(a, b) -> str | None:
    """None when identical (ids and logprob bits); else where the first difference is."""
    for i, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(a, b, strict=True)):
        if ids_a != ids_b:
            k = next(j for j, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
            return f"prompt {i} (length {LENGTHS[i]}): token ids differ at position {k}"
        if lp_a != lp_b:
            k = next(j for j, (x, y) in enumerate(zip(lp_a, lp_b)) if x != y)
            return f"prompt {i} (length {LENGTHS[i]}): logprob bits differ at position {k}: {lp_a[k]!r} vs {lp_b[k]!r}"
    return None


def assert_same_ids_close_logprobs(a, b, tol: float = 1e-4) -> None:
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b, strict=True):
        assert ids_a == ids_b
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) <= tol


# "auto" is fp32 for these tiny models (hidden < 256); bfloat16 is what "auto" picks for the default
# model on CPUs with native bf16.
@pytest.fixture(scope="module", params=["float32", "auto", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["default", "invariant"])
def mode(request) -> dict:
    if request.param == "invariant" and not cpu_attention.available():
        pytest.skip("invariant_attention needs the C attention kernel (STAGEWISE_KERNELS=off or no compiler)")
    return {"invariant_attention": request.param == "invariant"}


@pytest.fixture(scope="module")
def reference(llama_dir, dtype, mode):
    """One process, no prefix cache, each prompt alone; plus the same prompts as a batch of 6, inside
    a batch of 12 (first, so each prompt's prefill is one chunk of one step), and after the six
    others (459 tokens: the step budget of 512 runs out 17 tokens into the 57-token prompt, whose
    prefill then spans two steps)."""
    if dtype == "auto" and mode["invariant_attention"]:
        pytest.skip("auto is float32 on this model: the float32 case covers it")
    with LLM(model=str(llama_dir), dtype=dtype, enable_prefix_caching=False, **mode) as llm:
        yield {"alone": alone(llm), "batch6": run(llm, PROMPTS), "batch12": run(llm, PROMPTS + OTHERS)[:6],
               "again": alone(llm), "after_others": run(llm, OTHERS + PROMPTS)[6:]}


def test_the_same_run_twice_is_identical(reference):
    assert first_difference(reference["alone"], reference["again"]) is None


def test_alone_and_in_a_batch_are_identical(reference):
    """Batch rows do not change a row's bits (while its prefill stays one chunk): alone = in a batch of
    6 = in a batch of 12 with other prompts."""
    assert first_difference(reference["alone"], reference["batch6"]) is None
    assert first_difference(reference["alone"], reference["batch12"]) is None


def test_cold_prefix_cache_is_identical_to_no_cache(llama_dir, dtype, mode, reference):
    """Prefix caching on, first sight of each prompt: the same bits as with the cache off."""
    with LLM(model=str(llama_dir), dtype=dtype, **mode) as llm:
        assert first_difference(reference["alone"], alone(llm)) is None


def test_a_prompt_split_across_two_steps(reference, dtype, mode):
    """The batch of 12 in the other order: the 57-token prompt's prefill is cut where the step's
    token budget runs out and its second chunk attends over the cache. Invariant attention: the
    same bits as alone; default: the same ids in float32, logprobs close."""
    assert sum(map(len, OTHERS)) + sum(LENGTHS[:3]) < 512 < sum(map(len, OTHERS)) + sum(LENGTHS[:4])
    if mode["invariant_attention"]:
        assert first_difference(reference["alone"], reference["after_others"]) is None
    elif dtype == "bfloat16":
        pytest.skip("bf16 changes token ids under this split in the default mode (docs/determinism.md)")
    else:
        assert_same_ids_close_logprobs(reference["alone"], reference["after_others"])


@pytest.mark.parametrize("options", [{"chunked_prefill_size": 16}, {"chunked_prefill_size": 7},
                                     {"enable_prefix_caching": True}, {"speculative_config": SPEC}],
                         ids=["chunk16", "chunk7", "warm-cache", "ngram"])
def test_chunk_size_cache_hit_and_speculation(llama_dir, reference, dtype, mode, options):
    """Chunk sizes 16 and 7 (vs 512), a prefix-cache hit (the prompt run twice, the second compared:
    its full blocks come from the cache, only the rest is prefilled) and n-gram speculation (verify
    steps are short prefills over the cache). Invariant attention: the same token ids and logprob
    bits as the reference, in float32 and bfloat16. Default: in float32 the same ids, logprobs
    close (bf16 changes ids: not asserted)."""
    invariant = mode["invariant_attention"]
    if not invariant and (dtype == "bfloat16" or options.get("chunked_prefill_size") == 7):
        pytest.skip("default mode: bf16 changes ids under these splits (docs/determinism.md); chunk 16 covers 7")
    with LLM(model=str(llama_dir), dtype=dtype, **mode, **options) as llm:
        got = alone(llm)
        if options.get("enable_prefix_caching"):
            got = alone(llm)          # the second sight: the prompt's full blocks come from the cache
    if invariant:
        assert first_difference(reference["alone"], got) is None
    else:
        assert_same_ids_close_logprobs(reference["alone"], got)


def test_the_default_mode_moves_bits(llama_dir):
    """The bit check can fail: in the default mode chunk size 16 moves float32 logprob bits (the per-row
    kernel of invariant_attention is what keeps them)."""
    with LLM(model=str(llama_dir), dtype="float32", enable_prefix_caching=False) as llm:
        whole = alone(llm)
    with LLM(model=str(llama_dir), dtype="float32", enable_prefix_caching=False, chunked_prefill_size=16) as llm:
        chunked = alone(llm)
    assert first_difference(whole, chunked) is not None
    assert_same_ids_close_logprobs(whole, chunked)


@pytest.mark.slow
@pytest.mark.parametrize("pp_dtype", ["float32"])  # bfloat16 holds too (checked by hand; ~30 s more)
def test_two_pipeline_stages_are_identical_to_one(llama_dir, pp_dtype):
    """PP=2 (two stage processes) gives the bits of one process, alone and in a batch of 12."""
    with LLM(model=str(llama_dir), dtype=pp_dtype, enable_prefix_caching=False) as llm:
        one = alone(llm), run(llm, PROMPTS + OTHERS)[:6]
    with LLM(model=str(llama_dir), dtype=pp_dtype, enable_prefix_caching=False, pp_size=2) as llm:
        two = alone(llm), run(llm, PROMPTS + OTHERS)[:6]
    assert first_difference(one[0], two[0]) is None
    assert first_difference(one[1], two[1]) is None
