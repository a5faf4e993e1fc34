"""Sampler pieces on hand-made logits: filters, penalties, seeds, logprobs, validation."""
import math

import pytest
import torch

from stagewise.request import SamplingParams
from stagewise.runtime.sampler import Sampler, apply_penalties, filter_logits


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda p: torch.isfinite(filter_logits(logits.clone(), p)).nonzero().flatten().tolist()
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=0.7)) == [0, 1]           # 0.5 < 0.7, 0.8 crosses: keep the crosser
    assert kept(SamplingParams(top_p=0.5)) == [0]
    assert kept(SamplingParams(min_p=0.5)) == [0, 1]           # 0.15 < 0.5 * 0.5


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0]
    out = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [0], [2, 2])
    assert out.tolist() == [2.0, -2.0, 0.0, 0.0]                # prompt tokens are not penalised


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=123)
    draw = lambda s: [s.sample_row(logits.clone(), p, [], list(range(k)))[0] for k in range(20)]
    assert draw(Sampler(0)) == draw(Sampler(99))                # the engine seed does not matter
    other = SamplingParams(temperature=1.0, seed=124)
    assert draw(Sampler(0)) != [Sampler(0).sample_row(logits.clone(), other, [], list(range(k)))[0] for k in range(20)]


def test_greedy_and_logprobs():
    logits = torch.tensor([0.0, 3.0, 1.0])
    token, lp = Sampler().sample_row(logits.clone(), SamplingParams(temperature=0, logprobs=2), [], [])
    assert token == 1
    assert math.isclose(lp.logprob, float(logits.log_softmax(-1)[1]), rel_tol=1e-6)
    assert list(lp.top) == [1, 2]


def test_min_tokens_blocks_eos():
    logits = torch.tensor([0.0, 5.0, 1.0])
    token, _ = Sampler().sample_row(logits.clone(), SamplingParams(temperature=0, min_tokens=2), [], [], eos_ids=(1,))
    assert token == 2


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -3),
                                         ("max_tokens", 0), ("min_p", 2), ("presence_penalty", 3),
                                         ("repetition_penalty", 0), ("logprobs", 50), ("max_tokens", "8")])
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
