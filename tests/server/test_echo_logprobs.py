"""`echo` and logprobs over HTTP with the `openai` client: echoed prompts (text and token ids,
scored with max_tokens 0, streamed), prompt entries equal to offline `LLM` prompt logprobs and HF's
log_softmax, logprobs trimmed with the text by a stop string, chat logprobs without the end
token, per-choice seeds, and model retrieval."""
from __future__ import annotations

import json

import openai
import pytest

from stagewise import SamplingParams

try:
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPT = "The quick brown fox"
TOP = 2
EOS_CHAT = [{"role": "user", "content": "river cat"}]     # greedy on the fixture ends on <|eos|> (checked)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def prefix_offsets(tok, ids: list[int]) -> dict[int, int]:
    """text_offset oracle: len(decode(ids[:i])) wherever that prefix ends on a whole character."""
    out = {}
    for i in range(len(ids) + 1):
        text = tok.decode(ids[:i])
        if not text.endswith("\ufffd"):
            out[i] = len(text)
    return out


def close(got: list[float], want: list[float], tol: float = 1e-5) -> bool:
    return len(got) == len(want) and all(abs(a - b) < tol for a, b in zip(got, want))


def entries(lp) -> dict:
    return {k: getattr(lp, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def streamed_entries(chunks) -> dict:
    got = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for chunk in chunks:
        for choice in chunk.choices:
            for k in got:
                got[k] += getattr(choice.logprobs, k)
    return got


def test_echo_returns_prompt_then_completion(client, model, offline):
    tok = offline.engine.tok
    ids = tok.encode(PROMPT)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    for prompt in (PROMPT, ids, [ids, ids]):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, echo=True)
        assert [c.text for c in got.choices] == [tok.decode(ids) + plain.choices[0].text] * len(got.choices)
        assert got.choices[0].logprobs is None and got.usage.completion_tokens == 5 * len(got.choices)
    scored = client.completions.create(model=model, prompt=[ids], max_tokens=0, echo=True)
    assert scored.choices[0].text == PROMPT and scored.choices[0].finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)      # 0 only with echo
    assert err.value.body["param"] == "max_tokens"


def test_echo_logprobs_equal_offline_and_hf(client, model, offline, llama_dir, hf_logits):
    tok = offline.engine.tok
    ids = tok.encode(PROMPT)
    ref = offline.generate(prompt_token_ids=[ids], sampling_params=greedy(3, prompt_logprobs=TOP, logprobs=TOP),
                           use_tqdm=False)[0]
    hf = hf_logits(llama_dir, ids).log_softmax(-1)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                        logprobs=TOP)
    by_ids = client.completions.create(model=model, prompt=[ids], max_tokens=3, temperature=0, echo=True,
                                       logprobs=TOP)
    assert entries(by_text.choices[0].logprobs) == entries(by_ids.choices[0].logprobs)
    choice = by_text.choices[0]
    lp, out = choice.logprobs, ref.outputs[0]
    all_ids = ids + out.token_ids
    assert choice.text == PROMPT + out.text
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in all_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref.prompt_logprobs[i].logprob) < 1e-5
        assert abs(lp.token_logprobs[i] - float(hf[i - 1, ids[i]])) < 1e-4
        want = {tok.decode([t], skip_special_tokens=False): v for t, v in ref.prompt_logprobs[i].top.items()}
        assert lp.top_logprobs[i].keys() == want.keys()
        assert all(abs(lp.top_logprobs[i][k] - v) < 1e-5 for k, v in want.items())
    assert close(lp.token_logprobs[len(ids):], [e.logprob for e in out.logprobs])
    oracle = prefix_offsets(tok, all_ids)
    assert all(lp.text_offset[i] == off for i, off in oracle.items() if i < len(all_ids))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(choice.text)
    # what lm-evaluation-harness reads: the continuation's summed logprob, as LLM.score gives it
    context = tok.encode("The quick")
    harness = client.completions.create(model=model, prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                        logprobs=1, seed=1234)
    continuation = harness.choices[0].logprobs.token_logprobs[len(context):-1]
    assert abs(sum(continuation) - offline.score(["The quick"], [" brown fox"])[0]) < 1e-4


def test_streaming_echo_sends_the_prompt_first(client, model, offline):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                      logprobs=TOP)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                            logprobs=TOP, stream=True))
    ids = offline.engine.tok.encode(PROMPT)
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.finish_reason is None and len(first.logprobs.tokens) == len(ids)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert streamed_entries(chunks) == entries(whole.choices[0].logprobs)
    assert chunks[-1].choices[0].finish_reason == "length"
    scored = list(client.completions.create(model=model, prompt=[ids], max_tokens=0, echo=True, stream=True))
    assert [c.choices[0].text for c in scored] == [PROMPT, ""] and scored[-1].choices[0].finish_reason == "length"


def _stop_cutting_a_token(tok, ids: list[int], text: str) -> tuple[str, int, int]:
    """A stop string that first occurs one character into output token j and ends in token j + 1
    (so the engine generates past token j): (stop, cut, j)."""
    offsets = prefix_offsets(tok, ids)
    for j in range(1, len(ids) - 2):
        if not all(k in offsets for k in (j, j + 1, j + 2)) or offsets[j + 1] - offsets[j] < 2:
            continue
        cut = offsets[j] + 1
        for end in range(offsets[j + 1] + 1, len(text)):
            if text.find(text[cut:end]) == cut:
                return text[cut:end], cut, j
    raise AssertionError(f"no token to cut in {text!r}")


def test_stop_string_trims_logprobs_with_the_text(client, model, offline):
    tok = offline.engine.tok
    full = offline.generate(PROMPT, greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop, cut, j = _stop_cutting_a_token(tok, full.token_ids, full.text)
    ref = offline.generate(PROMPT, greedy(24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert ref.text == full.text[:cut] and len(ref.token_ids) > j + 1        # the engine ran past the cut
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1, stop=[stop],
                  extra_body={"ignore_eos": True})
    got = client.completions.create(**kwargs)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == ref.text and got.choices[0].finish_reason == "stop"
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in full.token_ids[:j + 1]]
    assert lp.text_offset[-1] < cut and len(lp.token_logprobs) == len(lp.top_logprobs) == j + 1
    assert got.usage.completion_tokens == len(ref.token_ids)     # every generated token counts, as vLLM
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert streamed_entries(chunks) == entries(lp)
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    assert echoed.logprobs.tokens[-(j + 1):] == lp.tokens
    assert echoed.logprobs.text_offset[-(j + 1):] == [len(PROMPT) + o for o in lp.text_offset]


def test_chat_logprobs_cover_the_content_only(client, model, offline):
    tok = offline.engine.tok
    ref = offline.chat(EOS_CHAT, greedy(40, logprobs=1))[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.token_ids[-1] in tok.eos_token_ids     # the premise
    kwargs = dict(model=model, messages=EOS_CHAT, max_tokens=40, temperature=0, logprobs=True, top_logprobs=1)
    got = client.chat.completions.create(**kwargs)
    content = got.choices[0].logprobs.content
    assert got.choices[0].message.content == ref.text and got.choices[0].finish_reason == "stop"
    assert [c.token for c in content] == [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids[:-1]]
    assert close([c.logprob for c in content], [e.logprob for e in ref.logprobs[:-1]])
    assert got.usage.completion_tokens == len(ref.token_ids)            # the end token is generated, and counted
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [c.token for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert streamed == [c.token for c in content]
    # legacy completions keep the generated end token last (harnesses drop the last entry)
    prompt = tok.chat_prompt(EOS_CHAT)
    legacy = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, logprobs=1)
    assert legacy.choices[0].logprobs.tokens[-1] == "<|eos|>"
    assert legacy.choices[0].logprobs.text_offset[-1] == len(legacy.choices[0].text)


def test_top_logprobs_over_the_limit_names_top_logprobs(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=EOS_CHAT, logprobs=True, top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"


def test_choice_seeds_do_not_collide_across_seeds(client, model):
    def texts(seed: int, n: int) -> list[str]:
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, n=n,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    s123, s124 = texts(123, 2), texts(124, 2)
    assert s124[0] != s123[1] and s123[0] != s123[1]
    assert texts(123, 2) == s123 and texts(123, 1) == s123[:1]       # reproducible; choice 0 keeps the seed


def test_models_retrieve(server, client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/models/no-such-model")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_generate_streams_prompt_logprobs_once(server, offline):
    ids = offline.engine.tok.encode(PROMPT)
    body = {"input_ids": ids, "sampling_params": {"max_tokens": 3, "temperature": 0, "prompt_logprobs": 1}}
    whole = httpx.post(server.url + "/generate", json=body, timeout=30).json()
    assert whole["prompt_logprobs"][0] is None and len(whole["prompt_logprobs"]) == len(ids)
    assert all(set(e) == {"token_id", "logprob", "top"} for e in whole["prompt_logprobs"][1:])
    with httpx.stream("POST", server.url + "/generate", json=dict(body, stream=True), timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    carrying = [e for e in events if "prompt_logprobs" in e]
    assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == whole["prompt_logprobs"]
