"""Structured outputs through `LLM`: outputs match their grammar (JSON schema, regex, choice, EBNF),
constrained greedy tokens are the same under every scheduling feature (micro-batches, chunked
prefill, preemption, prefix hits), free rows batched with constrained ones keep their tokens, and
bad grammars are refused with one sentence."""
import json
import re

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.runtime.sampler import Sampler, apply_token_bitmask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = [list(range(10, 15)), [(7 * i) % 900 + 3 for i in range(37)], list(range(200, 221))]


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str) and len(obj["name"]) <= 8
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and len(obj["tags"]) <= 3
            and all(t in ("a", "b") for t in obj["tags"]))


def _json(seed=None, temperature=0.0, **kw):
    return SamplingParams(max_tokens=80, temperature=temperature, seed=seed, structured_outputs={"json": SCHEMA},
                          **kw)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(model=str(llama_dir)) as engine:
        yield engine


def test_every_kind_of_grammar_is_obeyed(llm):
    params = [_json(seed=s, temperature=1.0) for s in range(8)] + [
        SamplingParams(max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"}),
        SamplingParams(max_tokens=20, structured_outputs={"choice": ["yes", "no", "maybe"]}),
        SamplingParams(max_tokens=20, structured_outputs={"guided_grammar": 'root ::= "(" [a-c]+ ")"'}),
        SamplingParams(max_tokens=60, structured_outputs={"json_object": True}),
    ]
    outs = llm.generate(prompt_token_ids=[PROMPTS[0]] * len(params), sampling_params=params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(_valid(t) for t in texts[:8]), [t for t in texts[:8] if not _valid(t)]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[:8])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[8])
    assert texts[9] in ("yes", "no", "maybe")
    # sampled (temperature 1): it may run to max_tokens before it closes
    assert re.fullmatch(r"\([a-c]+\)", texts[10]) or (outs[10].outputs[0].finish_reason == "length"
                                                     and re.fullmatch(r"\([a-c]*", texts[10]))
    assert texts[11].startswith("{")                    # any object: it may run to max_tokens
    if outs[11].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[11]), dict)


def test_free_rows_keep_their_tokens_next_to_constrained_ones(llm):
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=PROMPTS, sampling_params=free, use_tqdm=False)
    mixed = llm.generate(prompt_token_ids=PROMPTS + PROMPTS, sampling_params=[free] * 3 + [_json()] * 3,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(_valid(o.outputs[0].text) for o in mixed[3:])


def test_a_length_cut_says_length(llm):
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        max_tokens=3, temperature=0, structured_outputs={"json": SCHEMA}), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


@pytest.mark.slow          # a second engine (and grammar compiler) per case: seconds each
@pytest.mark.parametrize("options", [
    dict(pp_depth=2, chunked_prefill_size=8),              # micro-batches in flight, prompts in chunks
    dict(kv_cache_memory=28 * 4 * 2 * 4 * 2 * 16 * 4),     # 7 blocks: preemption and re-prefill
    dict(block_size=4),                                    # prefix hits on the shared prompt
])
def test_constrained_tokens_are_the_same_under_every_scheduling_feature(llama_dir, llm, options):
    prompts = PROMPTS + [PROMPTS[1] + [5, 6]]
    params = [_json()] * 4
    ref = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                        use_tqdm=False)]
    with LLM(model=str(llama_dir), **options) as other:
        outs = other.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        stats = other.stats()
    assert [(o.outputs[0].finish_reason, o.outputs[0].error) for o in outs] == [("stop", None)] * 4
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(_valid(o.outputs[0].text) for o in outs)
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("spec, words", [
    ({"json": SCHEMA, "regex": "a"}, "exactly one"),
    ({"jsonn": SCHEMA}, "unknown key"),
])
def test_malformed_constraints_are_one_sentence(spec, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(structured_outputs=spec)


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "strin"}}, "Unsupported type"),
    ({"regex": "[a-z"}, "Unclosed"),
    ({"grammar": "root ::= foo"}, "not defined"),
    ({"json": "{bad"}, "not valid JSON"),
])
def test_a_bad_grammar_fails_its_request_alone_with_one_sentence(llm, spec, words):
    outs = llm.generate(prompt_token_ids=[PROMPTS[0]] * 2, use_tqdm=False,
                        sampling_params=[SamplingParams(structured_outputs=spec), SamplingParams(max_tokens=2)])
    bad, good = outs[0].outputs[0], outs[1].outputs[0]
    assert (bad.finish_reason, bad.error_status) == ("error", 400) and words in bad.error, bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 2


def test_bitmask_touches_only_constrained_rows_and_logprobs_stay_finite():
    logits = torch.randn(3, 64)
    before = logits.clone()
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = 0b1010                                      # tokens 1 and 3 allowed
    apply_token_bitmask(logits, [1], bits)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[1, [1, 3]]).all() and torch.isinf(logits[1]).sum() == 62

    class Row:
        params = SamplingParams(temperature=0, logprobs=5)
        token_ids, num_prompt_tokens, input_embeds = [0], 1, None
    draws = Sampler().sample(before.clone(), [Row()] * 3, ([1], bits))
    assert draws[1].token in (1, 3)
    assert set(draws[1].logprob.top) == {1, 3}


@pytest.mark.parametrize("spec", [{"choice": ["a"]}, {"json_object": True}, {"regex": "[0-9]{2}"},
                                  {"grammar": 'root ::= "(" [a-c] ")"'}])
def test_a_finished_grammar_finishes_its_row_even_with_ignore_eos(llm, spec):
    """A grammar that is complete ends the output ("stop"); it never kills the engine, and the
    free request batched with it runs to its end."""
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured_outputs=spec), free]
    outs = llm.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=params, use_tqdm=False)
    constrained, bystander = outs[0].outputs[0], outs[1].outputs[0]
    assert constrained.error is None and bystander.error is None
    assert constrained.finish_reason in ("stop", "length")
    if "choice" in spec:
        assert constrained.finish_reason == "stop" and constrained.text == "a"
    assert bystander.finish_reason == "length" and len(bystander.token_ids) == 12
    assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].outputs[0].token_ids
