"""Sampler pieces on hand-made logits: filters, penalties, seeds, logprobs, validation, and
failure isolation (a row with non-finite logits fails alone)."""
import math
from dataclasses import dataclass, field

import pytest
import torch

from stagewise.request import SamplingParams
from stagewise.runtime.sampler import NONFINITE, Sampler, apply_penalties, filter_sorted


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    input_embeds: object = None


def kept(logits: torch.Tensor, p: SamplingParams) -> list[int]:
    values, order = logits.sort(dim=-1, descending=True, stable=True)
    mask = torch.isfinite(filter_sorted(values[None], [p])[0])
    return sorted(order[mask].tolist())


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert kept(logits, SamplingParams(top_k=2)) == [0, 1]
    assert kept(logits, SamplingParams(top_p=0.7)) == [0, 1]           # 0.5 < 0.7, 0.8 crosses: keep the crosser
    assert kept(logits, SamplingParams(top_p=0.5)) == [0]
    assert kept(logits, SamplingParams(top_p=1e-300)) == [0]           # a tiny top_p keeps the top token
    assert kept(logits, SamplingParams(min_p=0.5)) == [0, 1]           # 0.15 < 0.5 * 0.5


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.0])
    out = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.0]
    out = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [0], [2, 2])
    assert out.tolist() == [2.0, -2.0, 0.0, 0.0]                # prompt tokens are not penalised


def draws(sampler, logits, rows):
    return [d.token for d in sampler.sample(logits, rows)]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [draws(Sampler(0), logits, [Row(p, list(range(k)))])[0] for k in range(20)]
    assert alone == [draws(Sampler(99), logits, [Row(p, list(range(k)))])[0] for k in range(20)]
    # the same row batched behind an unseeded row and a filtered row draws the same tokens
    noise = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    batch = torch.cat([noise, logits])
    others = [Row(SamplingParams(temperature=0.7)), Row(SamplingParams(top_k=5, seed=7))]
    assert alone == [draws(Sampler(5), batch, others + [Row(p, list(range(k)))])[2] for k in range(20)]
    other = SamplingParams(temperature=1.0, seed=124)
    assert alone != [draws(Sampler(0), logits, [Row(other, list(range(k)))])[0] for k in range(20)]


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    counts = torch.bincount(torch.tensor(draws(Sampler(3), logits, [Row(SamplingParams())] * 4000)), minlength=3)
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_filtered_draws_follow_the_renormalised_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    for params, expect in [(SamplingParams(top_k=2), [0.625, 0.375, 0, 0]),
                           (SamplingParams(top_p=0.7), [0.625, 0.375, 0, 0]),
                           (SamplingParams(min_p=0.25), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])]:
        counts = torch.bincount(torch.tensor(draws(Sampler(3), logits, [Row(params)] * 4000)), minlength=4)
        assert torch.allclose(counts / 4000, torch.tensor(expect), atol=0.03), params


def test_a_seeded_top_k_row_does_not_depend_on_its_neighbours_top_k():
    """Rows that all have a top-k are ranked with one partial sort as wide as the widest; the
    draw of a seeded row must not change with that width."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0, top_k=20, seed=9)
    alone = [draws(Sampler(0), logits, [Row(p, list(range(k)))])[0] for k in range(20)]
    batch = torch.cat([torch.randn(1, 500), logits])
    for other in (SamplingParams(top_k=300), SamplingParams(top_p=0.9), SamplingParams()):
        assert alone == [draws(Sampler(1), batch, [Row(other), Row(p, list(range(k)))])[1] for k in range(20)]


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.75])
def test_top_p_on_the_head_of_the_ranking_cuts_where_a_full_sort_does(monkeypatch, top_p):
    """An 8k-token row whose top-1024 head holds 78% of the mass: only the head is ranked."""
    import stagewise.runtime.sampler as sampler_mod
    logits = 2 * torch.randn(1, 8192, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=11)
    head_mass = logits.topk(sampler_mod.TOP_P_HEAD).values.logsumexp(-1) - logits.logsumexp(-1)
    assert head_mass.exp().item() > top_p
    head = [draws(Sampler(0), logits, [Row(params, list(range(k)))])[0] for k in range(100)]
    monkeypatch.setattr(sampler_mod, "TOP_P_HEAD", 10 ** 6)           # every row fully sorted
    full = [draws(Sampler(0), logits, [Row(params, list(range(k)))])[0] for k in range(100)]
    assert head == full and len(set(head)) > 1


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    (d,) = Sampler().sample(logits, [Row(SamplingParams(temperature=0, logprobs=2))])
    assert d.token == 1 and d.error is None
    assert math.isclose(d.logprob.logprob, float(logits[0].log_softmax(-1)[1]), rel_tol=1e-6)
    assert list(d.logprob.top) == [1, 2]


def test_min_tokens_blocks_eos():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    row = Row(SamplingParams(temperature=0, min_tokens=2))
    assert draws(Sampler(eos_token_ids=(1,)), logits, [row]) == [2]
    assert draws(Sampler(eos_token_ids=(1,)), logits, [Row(row.params, [4, 4])]) == [1]   # two outputs: free


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-300).is_greedy and SamplingParams(temperature=5e-324).is_greedy
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(4))
    rows = [Row(SamplingParams(temperature=t)) for t in (1e-45, 1e-6, 0.0, 1e-300, 1e-45, 0, 1e-7, 0)]
    assert draws(Sampler(), logits, rows) == logits.argmax(-1).tolist()


def test_a_row_with_non_finite_logits_fails_alone():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(5))
    logits[1, 3] = float("nan")
    logits[2, :] = float("inf")
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams()), Row(SamplingParams(seed=1, logprobs=2)),
            Row(SamplingParams(temperature=0.5, top_p=0.9))]
    out = Sampler().sample(logits, rows)
    assert [d.error for d in out] == [None, NONFINITE, NONFINITE, None]
    assert out[0].token == int(logits[0].argmax()) and out[3].token is not None


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -3),
                                         ("max_tokens", 0), ("min_p", 2), ("presence_penalty", 3),
                                         ("repetition_penalty", 0), ("repetition_penalty", 1e-300),
                                         ("logprobs", 50), ("max_tokens", "8"), ("temperature", float("inf")),
                                         ("temperature", float("nan")), ("top_p", float("nan")),
                                         ("skip_special_tokens", "no"), ("ignore_eos", "yes"), ("stop", 5),
                                         ("stop_token_ids", 5), ("stop", ["x"] * 65), ("stop", ["x" * 513]),
                                         ("min_tokens", 17)])
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
