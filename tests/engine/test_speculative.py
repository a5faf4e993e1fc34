"""Speculative decoding (n-gram prompt lookup): the proposer, the config's errors, and the engine's
outputs with drafts against the same engine without them: greedy tokens identical (batched,
chunked prefill, prefix hits, penalties, logprobs, stop strings / stop tokens / EOS / max_tokens
inside an accepted run, PP=2, the compiled backend), seeded sampling identical, unseeded sampling
the same distribution (chi-square), and KV blocks all back after runs that were often rejected.

Random tiny models rarely repeat themselves, so most engine tests use an oracle proposer: it
proposes the reference continuation with every third draft run corrupted, which exercises long
accepted runs and mid-run rejections; the n-gram proposer itself runs end to end in one test.
"""
import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig, SpeculativeConfig
from stagewise.engine.speculative import NgramProposer
from stagewise.request import Request

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
EOS_PROMPT = [900, 156, 948, 42, 865, 85, 922, 719]     # the tiny llama's greedy output has EOS (1) at index 16
PROMPTS = [EOS_PROMPT, list(range(10, 15)), [(7 * i) % 900 + 3 for i in range(37)], [5, 9, 11] * 6]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
VOCAB = 1000


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


# the proposer and the config

def _req(ids, rid="r", max_tokens=100, prompt_len=None):
    n = len(ids) if prompt_len is None else prompt_len
    req = Request(rid, list(ids[:n]), SamplingParams(max_tokens=max_tokens))
    req.output_token_ids = list(ids[n:])
    return req


def test_ngram_proposes_what_followed_the_latest_longest_match():
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1), 1000)
    # suffix [7, 8] occurred twice: the latest occurrence (followed by 4, 5, 6) wins
    assert prop.propose(_req([7, 8, 1, 2, 3, 9, 7, 8, 4, 5, 6, 7, 8]), 10) == [4, 5, 6]
    # the longest match wins over a later shorter one: [2, 7, 8] -> 1, 1 follows
    assert prop.propose(_req([2, 7, 8, 1, 1, 3, 8, 5, 2, 7, 8], "b"), 10) == [1, 1, 3]
    assert prop.propose(_req([1, 2, 3, 4], "c"), 10) == []                 # nothing repeats
    # bounded by the step's budget, the tokens left (the step yields drafts + 1) and the context
    assert prop.propose(_req([7, 8, 1, 2, 3, 7, 8], "d"), 2) == [1, 2]
    assert prop.propose(_req([7, 8, 1, 2, 3, 7, 8], "e", max_tokens=3, prompt_len=5), 10) == []
    assert NgramProposer(SpeculativeConfig(), 9).propose(_req([7, 8, 1, 2, 3, 7, 8], "f"), 10) == [1]


def test_ngram_state_is_per_request_and_incremental():
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=2), 1000)
    a = _req([1, 2, 3, 4, 1, 2], "a")
    assert prop.propose(a, 10) == [3, 4]
    assert prop.propose(_req([5, 1, 2], "b"), 10) == []        # a's n-grams are not b's
    a.output_token_ids += [9, 9, 3]                             # a grows: [..., 1, 2, 9, 9, 3]
    a.output_token_ids += [1, 2]
    assert prop.propose(a, 10) == [9, 9]                        # the newest occurrence now
    prop.forget("a")
    assert "a" not in prop.states


def test_adaptive_draft_length():
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1), 1000)
    req = _req(list(range(20, 40)) + list(range(20, 22)))
    assert len(prop.propose(req, 100)) == 8
    prop.record("r", 8, 1)                                      # one accepted: at most 2 next
    assert len(prop.propose(req, 100)) == 2
    prop.record("r", 2, 2)                                      # all accepted: twice as many
    assert len(prop.propose(req, 100)) == 4
    prop.record("r", 4, 4)
    assert len(prop.propose(req, 100)) == 8
    fixed = NgramProposer(SpeculativeConfig(num_speculative_tokens=8, adaptive_draft_length=False), 1000)
    fixed.propose(req, 100)
    fixed.record("r", 8, 0)
    assert len(fixed.propose(req, 100)) == 8


def test_backoff_pauses_a_request_with_low_acceptance_then_resumes():
    cfg = SpeculativeConfig(num_speculative_tokens=4, backoff_window=8, backoff_min_acceptance=0.5, backoff_steps=3,
                            adaptive_draft_length=False)
    prop = NgramProposer(cfg, 1000)
    req = _req([7, 8, 1, 2, 3, 7, 8])
    assert prop.propose(req, 10)
    prop.record("r", 4, 0)
    assert prop.propose(req, 10)
    prop.record("r", 4, 1)                                      # 1 of 8 accepted: back off
    assert [prop.propose(req, 10) for _ in range(3)] == [[], [], []]
    assert prop.propose(req, 10) == [1, 2, 3, 7]
    s = prop.stats.snapshot()
    assert (s["proposed"], s["accepted"], s["verify_steps"], s["backoffs"]) == (8, 1, 2, 1)
    assert s["acceptance_rate"] == 1 / 8 and s["mean_accepted_length"] == 1.5
    prop.record("r", 4, 4)                                      # a good step: no back-off
    assert prop.propose(req, 10)
    prop.record("r", 4, 0)                                      # 4 of the last 8: still proposing
    assert prop.states["r"].paused_steps == 0
    prop.record("r", 4, 0)                                      # 0 of the last 8: again, twice as long
    assert [bool(prop.propose(req, 10)) for _ in range(7)] == [False] * 6 + [True]


@pytest.mark.parametrize("bad, words", [
    ('{"method": "eagle"}', "method must be one of ngram"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min (5) must be at most"),
    ({"method": "ngram", "lookahead": 3}, "unknown key(s) lookahead"),
    ("{not json", "must be a JSON object"),
    ({"num_speculative_tokens": 2}, "needs a method"),
])
def test_bad_speculative_config_is_one_sentence(bad, words):
    with pytest.raises(ValueError) as exc:
        EngineConfig.from_kwargs(speculative_config=bad)
    text = str(exc.value)
    assert words in text and "\n" not in text and text.endswith(".")


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_cli_flag_reaches_the_config(llama_dir, command):
    from stagewise.cli import build_parser, config_from_args
    args = build_parser().parse_args([command, "--model", str(llama_dir), "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3}'])
    spec = config_from_args(args).scheduler.speculative_config
    assert spec is not None and spec.num_speculative_tokens == 3


# the engine, greedy

class Oracle:
    """Proposes the reference continuation; every third call corrupts one draft (a mid-run rejection)."""

    def __init__(self, engine, refs: dict[tuple, list[int]], wrong_every: int = 3):
        self.spec, self.refs, self.wrong_every, self.calls = engine.speculator, refs, wrong_every, 0
        self.spec.propose = self.propose

    def propose(self, req, budget):
        k = self.spec.max_drafts(req, budget)
        n = len(req.output_token_ids)
        drafts = list(self.refs[tuple(req.prompt_token_ids)][n:n + k])
        self.calls += 1
        if drafts and self.calls % self.wrong_every == 0:
            i = self.calls % len(drafts)
            drafts[i] = (drafts[i] + 1) % VOCAB
        return drafts


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The engine without speculation: greedy tokens of PROMPTS (ignore_eos) and a few outputs to compare."""
    with LLM(model=str(llama_dir)) as llm:
        yield llm, {tuple(p): t for p, t in zip(PROMPTS, tokens(llm.generate(
            prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)))}


@pytest.fixture(scope="module")
def spec_llm(llama_dir, reference):
    with LLM(model=str(llama_dir), speculative_config=SPEC, block_size=4) as llm:
        yield llm


def _same_outputs(a, b):
    for x, y in zip(a, b, strict=True):
        cx, cy = x.outputs[0], y.outputs[0]
        assert (cx.token_ids, cx.text, cx.finish_reason) == (cy.token_ids, cy.text, cy.finish_reason)


def test_greedy_oracle_drafts_keep_tokens_and_return_blocks(spec_llm, reference):
    oracle = Oracle(spec_llm.engine, reference[1])
    before = dict(spec_llm.stats()["speculative"])
    got = tokens(spec_llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
    assert got == [reference[1][tuple(p)] for p in PROMPTS]
    s = spec_llm.stats()
    proposed, accepted = (s["speculative"][k] - before[k] for k in ("proposed", "accepted"))
    assert oracle.calls and 0.5 * proposed < accepted < proposed      # long runs, and rejections
    assert s["kv_usage"] == 0.0 and not spec_llm.engine.scheduler.records


@pytest.mark.parametrize("case", ["stop_string", "stop_token", "eos", "max_tokens", "min_tokens", "penalties",
                                  "logprobs"])
def test_stop_rules_and_sampling_rules_inside_accepted_runs(spec_llm, reference, case):
    ref_llm, refs = reference
    eos_ref = refs[tuple(EOS_PROMPT)]
    assert eos_ref.index(1) == 16                     # the model emits EOS mid-way (the fixture's premise)
    text_at = ref_llm.engine.tok.decode(eos_ref[9:11])
    params = {
        "stop_string": SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[text_at.strip()[:4]]),
        "stop_token": SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[eos_ref[7]]),
        "eos": SamplingParams(max_tokens=32, temperature=0),
        "max_tokens": SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
        "min_tokens": SamplingParams(max_tokens=32, temperature=0, min_tokens=18),
        "penalties": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                                    presence_penalty=0.5, frequency_penalty=0.3),
        "logprobs": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2),
    }[case]
    want = ref_llm.generate(prompt_token_ids=[EOS_PROMPT], sampling_params=params, use_tqdm=False)
    ref_of = {tuple(EOS_PROMPT): want[0].outputs[0].token_ids + [3] * 32}   # past its end: wrong drafts
    Oracle(spec_llm.engine, ref_of, wrong_every=4)
    before = spec_llm.stats()["speculative"]["accepted"]
    got = spec_llm.generate(prompt_token_ids=[EOS_PROMPT], sampling_params=params, use_tqdm=False)
    _same_outputs(got, want)
    assert spec_llm.stats()["speculative"]["accepted"] - before >= 4
    if case in ("stop_string", "stop_token", "eos"):
        assert want[0].outputs[0].finish_reason == "stop" and len(want[0].outputs[0].token_ids) < 20
    if case == "logprobs":
        a, b = got[0].outputs[0].logprobs, want[0].outputs[0].logprobs
        assert a is not None and b is not None and len(a) == len(b) == 20
        assert all(x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4 and x.top.keys() == y.top.keys()
                   for x, y in zip(a, b))
    assert spec_llm.stats()["kv_usage"] == 0.0


def test_preemption_with_drafts_keeps_tokens(llama_dir, reference):
    """~28 blocks of 16 for 4 requests of up to 69 tokens: requests are preempted and recomputed."""
    with LLM(model=str(llama_dir), speculative_config=SPEC, kv_cache_memory=28 * 4 * 2 * 4 * 2 * 16 * 4) as llm:
        Oracle(llm.engine, reference[1])
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        s = llm.stats()
    assert got == [reference[1][tuple(p)] for p in PROMPTS]
    assert s["num_preemptions"] > 0 and s["speculative"]["accepted"] > 0 and s["kv_usage"] == 0.0


def test_ngram_end_to_end_chunked_prefill_and_prefix_hits(llama_dir, reference):
    """The real proposer, on prompts that repeat, with chunks of 8 and cached prefixes."""
    prompts = [PROMPTS[3], PROMPTS[2] * 2, PROMPTS[2] * 2 + [5, 9]]
    with LLM(model=str(llama_dir), enable_prefix_caching=False) as llm:
        want = tokens(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    with LLM(model=str(llama_dir), speculative_config=SPEC, chunked_prefill_size=8, block_size=4) as llm:
        first = tokens(llm.generate(prompt_token_ids=prompts[:2], sampling_params=GREEDY, use_tqdm=False))
        second = llm.generate(prompt_token_ids=prompts[2:], sampling_params=GREEDY, use_tqdm=False)
        s = llm.stats()
    assert first + tokens(second) == want
    assert second[0].num_cached_tokens >= 64
    assert s["speculative"]["proposed"] > 0 and s["kv_usage"] == 0.0


# the engine, sampling

def test_seeded_sampling_is_identical_with_and_without_drafts(spec_llm, reference):
    ref_llm, refs = reference
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in range(6)]
    prompts = [PROMPTS[1]] * 6
    want = ref_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    Oracle(spec_llm.engine, {tuple(PROMPTS[1]): tokens(want)[0]})    # right for seed 0, wrong often for others
    got = spec_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    again = spec_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert tokens(again) == tokens(want)


def test_unseeded_sampling_keeps_the_distribution(spec_llm, reference):
    """Two-sample chi-square on the tokens at output positions 1..3 (after accepted or rejected drafts):
    300 unseeded samples each way; drafts follow the most frequent continuation of the plain samples."""
    from collections import Counter

    from scipy.stats import chi2_contingency
    ref_llm, refs = reference
    prompt, n = PROMPTS[1], 300
    params = SamplingParams(max_tokens=4, temperature=0.4, top_k=20, ignore_eos=True)
    want = tokens(ref_llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params, use_tqdm=False))
    mode = {}
    for prefix in {tuple(t[:i]) for t in want for i in range(1, 4)}:
        mode[prefix] = Counter(t[len(prefix)] for t in want if tuple(t[:len(prefix)]) == prefix).most_common(1)[0][0]
    spec = spec_llm.engine.speculator

    def propose(req, budget):
        drafts, out = [], tuple(req.output_token_ids)
        for _ in range(spec.max_drafts(req, budget)):
            if out not in mode:
                break
            drafts.append(mode[out])
            out += (drafts[-1],)
        return drafts
    spec.propose = propose
    before = dict(spec_llm.stats()["speculative"])
    got = tokens(spec_llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params, use_tqdm=False))
    s = spec_llm.stats()["speculative"]
    proposed, accepted = s["proposed"] - before["proposed"], s["accepted"] - before["accepted"]
    assert 0.1 * proposed < accepted < 0.9 * proposed          # drafts both accepted and rejected often
    for pos in (1, 2, 3):
        counts = [Counter(t[pos] for t in rows) for rows in (want, got)]
        common = [t for t in set(counts[0]) | set(counts[1]) if counts[0][t] + counts[1][t] >= 10]
        table = [[c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)] for c in counts]
        table = [list(col) for col in zip(*table) if sum(col)]
        assert len(table) >= 2 and chi2_contingency(list(zip(*table)))[1] > 1e-3, (pos, table)


# pipelines and compiled steps

@pytest.mark.slow
def test_pp2_with_micro_batches_keeps_tokens(llama_dir, reference):
    with LLM(model=str(llama_dir), speculative_config=SPEC, pp_size=2, block_size=4) as llm:
        Oracle(llm.engine, reference[1])
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        s = llm.stats()
    assert got == [reference[1][tuple(p)] for p in PROMPTS]
    assert s["speculative"]["accepted"] > 0 and s["kv_usage"] == 0.0


@pytest.mark.slow
def test_compiled_backend_verify_steps_keep_tokens(llama_dir, reference):
    with LLM(model=str(llama_dir), speculative_config=SPEC, prefill_graph="compiled", dtype="float32",
             compile_in_background=False) as llm:
        Oracle(llm.engine, reference[1])
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        s = llm.stats()
    assert got == [reference[1][tuple(p)] for p in PROMPTS]
    assert s["speculative"]["accepted"] > 0 and sum(s["prefill_graph"]["replays"].values()) > 0
    assert sum(s["decode_graph"]["replays"].values()) > 0      # verify steps take the few-rows graph
