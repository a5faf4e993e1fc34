"""The OpenAI-compatible endpoints and /generate against the offline `LLM` (greedy results equal),
driven by the real `openai` client and raw HTTP for the SSE framing."""
from __future__ import annotations

import json

import torch

from stagewise import SamplingParams

try:
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPTS = ["The quick brown fox", "Once upon a time there was"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def sse_events(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_models_and_health(server, client, llama_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [llama_dir.name]      # default served name: the directory's name
    assert str(llama_dir) not in httpx.get(server.url + "/v1/models").text          # never the path
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completions_match_offline(client, offline):
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0)
    ref = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [c.text for c in got.choices] == [r.outputs[0].text for r in ref]
    assert [c.finish_reason for c in got.choices] == [r.outputs[0].finish_reason for r in ref]
    assert got.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert got.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)


def test_completions_token_id_prompt_and_default_max_tokens(client, offline):
    ids = [11, 22, 33, 44, 55]
    got = client.completions.create(model=client.models.list().data[0].id, prompt=ids, temperature=0,
                                    extra_body={"ignore_eos": True})
    ref = offline.generate(prompt_token_ids=[ids], sampling_params=greedy(16, ignore_eos=True), use_tqdm=False)
    assert got.choices[0].text == ref[0].outputs[0].text
    assert got.usage.completion_tokens == 16          # OpenAI's default max_tokens for completions


def test_chat_matches_offline(client, offline):
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                         max_completion_tokens=10, temperature=0)
    ref = offline.chat(MESSAGES, greedy(10))
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref[0].outputs[0].text
    assert got.usage.prompt_tokens == len(ref[0].prompt_token_ids)


def test_streaming_equals_non_streaming(server, client):
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    parts = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].choices == [] and parts[-1].usage.total_tokens == whole.usage.total_tokens
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=15, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=15, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    body = {"model": model, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def _embedding_rows(model_dir, ids: list[int]) -> list[list[float]]:
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return table[torch.tensor(ids)].float().tolist()


def test_generate_text_ids_and_embeds_agree(server, llama_dir, offline):
    ids = offline.engine.tok.encode(PROMPTS[1])
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    by_text = httpx.post(server.url + "/generate", json={"text": PROMPTS[1], "sampling_params": params}).json()
    by_ids = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": params}).json()
    r = httpx.post(server.url + "/generate", json={"input_embeds": _embedding_rows(llama_dir, ids),
                                                   "sampling_params": params}, timeout=30)
    assert r.status_code == 200, r.text
    by_embeds = r.json()
    ref = offline.generate(prompt_token_ids=[ids], sampling_params=greedy(10, ignore_eos=True), use_tqdm=False)
    assert by_text["token_ids"] == by_ids["token_ids"] == by_embeds["token_ids"] == ref[0].outputs[0].token_ids
    assert by_embeds["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream("POST", server.url + "/generate", json={"input_ids": ids, "sampling_params": params,
                                                             "stream": True}, timeout=30) as resp:
        events = sse_events(resp)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 10
    assert sum((c.get("token_ids", []) for c in chunks), []) == by_ids["token_ids"]


def test_logprobs_and_n(client):
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    many = client.completions.create(model=model, prompt=PROMPTS, max_tokens=5, temperature=0.8, seed=7, n=3)
    assert sorted(c.index for c in many.choices) == list(range(6))
    again = client.completions.create(model=model, prompt=PROMPTS, max_tokens=5, temperature=0.8, seed=7, n=3)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]     # seeded: reproducible


def test_stop_strings_match_offline(client, offline):
    model = client.models.list().data[0].id
    ref = offline.generate(PROMPTS[0], greedy(30, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = ref[len(ref) // 2: len(ref) // 2 + 2]
    got = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    expected = offline.generate(PROMPTS[0], greedy(30, stop=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].text == expected.text and got.choices[0].finish_reason == expected.finish_reason
    assert stop not in got.choices[0].text


def test_generate_prompt_logprobs_scores_a_prompt(server, offline):
    """max_tokens 0 with prompt_logprobs: the prompt's log-likelihood, as offline `LLM` gives it."""
    ids = offline.engine.tok.encode(PROMPTS[0])
    body = {"input_ids": ids, "sampling_params": {"max_tokens": 0, "prompt_logprobs": 1}}
    got = httpx.post(server.url + "/generate", json=body, timeout=30).json()
    ref = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=1),
                           use_tqdm=False)[0].prompt_logprobs
    assert got["token_ids"] == [] and got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(ids)
    assert [e["token_id"] for e in got["prompt_logprobs"][1:]] == ids[1:]
    assert all(abs(e["logprob"] - r.logprob) < 1e-4 and len(e["top"]) == 1
               for e, r in zip(got["prompt_logprobs"][1:], ref[1:]))
    no_score = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_tokens": 0}})
    assert no_score.status_code == 400 and no_score.json()["error"]["param"] == "sampling_params.max_tokens"
