"""A randomized hunt for differences: one set of requests (mixed prompt lengths, greedy and seeded
sampling, logprobs) run under many splits of the work with `invariant_attention=True`, each run
compared exactly (token ids and logprob bits) with one process that runs every request alone.

Every run draws its splits from a seed (printed; `STAGEWISE_HUNT_SEED=N` replays one): the dtype
(float32 or bfloat16), batch sizes (`max_num_seqs` 2-64, requests in a shuffled order), chunk
sizes (7-512), the prefix cache cold and warm, n-gram speculation; the slow cases add pipeline
stages (PP 2 or 3), tensor-parallel ranks (TP 2) and a stage killed mid-run (the pipeline rebuilt
and every live request recomputed). A difference names the request, the split and the position.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest

from stagewise import LLM, SamplingParams
from stagewise.kernels import attention as cpu_attention

SEED = int(os.environ.get("STAGEWISE_HUNT_SEED") or random.SystemRandom().randrange(1 << 20))
SPEC = {"method": "ngram", "num_speculative_tokens": 4}

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="invariant_attention needs the C attention kernel (CI builds it)")


def requests(rng: random.Random, n: int = 10, max_tokens: int = 16) -> list[tuple[list[int], SamplingParams]]:
    """`n` prompts of 1-150 tokens (some a repeated pattern, for the n-gram proposer), every other one
    greedy, the rest sampled at temperature 0.9 / top-p 0.9 with a seed of their own."""
    out = []
    for i in range(n):
        length = rng.randrange(1, 151)
        pattern = [rng.randrange(3, 990) for _ in range(rng.randrange(2, 7))]
        prompt = ([pattern[j % len(pattern)] for j in range(length)] if rng.random() < 0.5
                  else [rng.randrange(3, 990) for _ in range(length)])
        params = (SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True) if i % 2 == 0
                  else SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=rng.randrange(1 << 30),
                                      logprobs=0, ignore_eos=True))
        out.append((prompt, params))
    return out


def run(llm: LLM, reqs, order: list[int] | None = None) -> list[tuple[list[int], list[float]]]:
    """(token ids, chosen tokens' logprobs) per request, in `reqs` order, submitted in `order`."""
    order = order if order is not None else list(range(len(reqs)))
    outs = llm.generate(prompt_token_ids=[reqs[i][0] for i in order],
                        sampling_params=[reqs[i][1] for i in order], use_tqdm=False)
    got: list = [None] * len(reqs)
    for i, o in zip(order, outs):
        got[i] = (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
    return got


def difference(reqs, want, got, split: str) -> str | None:
    for i, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(want, got, strict=True)):
        kind = "greedy" if reqs[i][1].temperature == 0 else "sampled"
        if ids_a != ids_b:
            k = next((j for j, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            return f"seed {SEED}, {split}: request {i} ({kind}, {len(reqs[i][0])} tokens) token ids differ at {k}"
        if lp_a != lp_b:
            k = next(j for j, (x, y) in enumerate(zip(lp_a, lp_b)) if x != y)
            return (f"seed {SEED}, {split}: request {i} ({kind}, {len(reqs[i][0])} tokens) logprob bits differ "
                    f"at {k}: {lp_a[k]!r} vs {lp_b[k]!r}")
    return None


@pytest.fixture(scope="module")
def hunt(llama_dir):
    """The drawn dtype and requests, and the reference: one process, each request alone, no cache."""
    rng = random.Random(SEED)
    dtype = rng.choice(["float32", "bfloat16"])
    reqs = requests(rng)
    print(f"\nhunt seed {SEED} (STAGEWISE_HUNT_SEED={SEED} replays it): {dtype}")
    base = dict(model=str(llama_dir), dtype=dtype, invariant_attention=True)
    with LLM(**base, enable_prefix_caching=False, max_num_seqs=1) as llm:
        want = run(llm, reqs)
    return rng, base, reqs, want


def test_batches_chunks_cache_and_speculation(hunt):
    """Three drawn in-process splits: a batch size and order, a chunk size, the prefix cache warm
    (every request run twice, the second compared) or n-gram speculation."""
    rng, base, reqs, want = hunt
    for _ in range(3):
        options = {"max_num_seqs": rng.choice([2, 5, 16, 64]), "chunked_prefill_size": rng.choice([7, 16, 64, 512])}
        extra = rng.choice(["warm-cache", "ngram", "none"])
        if extra == "ngram":
            options["speculative_config"] = SPEC
        order = rng.sample(range(len(reqs)), len(reqs))
        with LLM(**base, enable_prefix_caching=extra == "warm-cache", **options) as llm:
            got = run(llm, reqs, order)
            if extra == "warm-cache":
                got = run(llm, reqs, rng.sample(range(len(reqs)), len(reqs)))
        found = difference(reqs, want, got, f"{options}, {extra}, order {order}")
        assert found is None, found


@pytest.mark.slow
def test_stages_and_ranks(hunt):
    """A drawn process split: PP 2 or 3, TP 1 or 2 (not both 1), a drawn chunk size, all at once."""
    rng, base, reqs, want = hunt
    pp, tp = rng.choice([(2, 1), (3, 1), (1, 2), (2, 2)])
    options = {"pp_size": pp, "tp_size": tp, "chunked_prefill_size": rng.choice([16, 64, 512])}
    with LLM(**base, **options) as llm:
        got = run(llm, reqs, rng.sample(range(len(reqs)), len(reqs)))
    found = difference(reqs, want, got, str(options))
    assert found is None, found


@pytest.mark.slow
def test_a_stage_killed_mid_run(hunt):
    """PP=2: the last stage is killed while the requests decode; the rebuilt pipeline recomputes every
    live request and they continue as the undisturbed run did."""
    rng, base, _, _ = hunt
    reqs = requests(random.Random(SEED + 1), n=8, max_tokens=350)     # prompts of at most 150: 512 positions
    with LLM(**base, enable_prefix_caching=False) as llm:          # batch-invariant: all at once
        want = run(llm, reqs)
    with LLM(**base, pp_size=2, max_pipeline_restarts=1, pipeline_spares=False) as llm:
        stage = llm.engine.executor.procs[-1]
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(stage.pid, signal.SIGKILL)
        timer = threading.Timer(rng.uniform(0.3, 0.7), kill)
        timer.start()
        got = run(llm, reqs)
        finished = time.monotonic()
        timer.cancel()
        assert killed_at and killed_at[0] < finished, "the requests ended before the kill: make them longer"
        assert llm.stats()["recovery"]["rebuilds"] == {"stage_died": 1}
    found = difference(reqs, want, got, "PP=2, last stage killed mid-run")
    assert found is None, found
