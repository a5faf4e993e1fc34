"""What a vLLM client relies on, through the real `openai` SDK and raw HTTP: vLLM's request
extensions with vLLM's meaning (the offline `LLM` with the same SamplingParams is the oracle),
unknown fields ignored with one warning per name, the utility endpoints (/tokenize, /detokenize,
/version, /ping), cache_salt and per-API-key cache isolation, and the Host check (DNS rebinding)."""
from __future__ import annotations

import json

import pytest

from stagewise import SamplingParams

try:
    import httpx2 as httpx
except ImportError:
    import httpx

LONG_IDS = [(13 * i) % 800 + 5 for i in range(40)]        # > 2 blocks of 16: prefix-cacheable
MSG = [{"role": "user", "content": "Name a colour."}]


def model_of(client) -> str:
    return client.models.list().data[0].id


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in logprobs_tokens), logprobs_tokens
    return [int(t.split(":", 1)[1]) for t in logprobs_tokens]


def test_logits_processors_match_offline(client, offline):
    fields = dict(allowed_token_ids=list(range(100, 200)), bad_words=["ab", "the"], seed=5,
                  include_stop_str_in_output=True)
    got = client.completions.create(model=model_of(client), prompt=LONG_IDS[:9], max_tokens=10, temperature=0.8,
                                    logit_bias={"150": 4.0, "160": -100}, logprobs=0,
                                    extra_body=dict(fields, ignore_eos=True, return_tokens_as_token_ids=True))
    ids = token_ids(got.choices[0].logprobs.tokens)
    ref = offline.generate(prompt_token_ids=[LONG_IDS[:9]], use_tqdm=False, sampling_params=SamplingParams(
        max_tokens=10, temperature=0.8, ignore_eos=True, logit_bias={150: 4.0, 160: -100.0}, **fields))
    assert ids == ref[0].outputs[0].token_ids and set(ids) <= set(range(100, 200)) - {160}
    forced = client.completions.create(model=model_of(client), prompt="hello", max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert token_ids(forced.choices[0].logprobs.tokens) == [42] * 4
    assert all(k.startswith("token_id:") for k in forced.choices[0].logprobs.top_logprobs[0])


def test_prompt_logprobs_truncation_and_stop_strings(client, offline):
    got = client.completions.create(model=model_of(client), prompt=LONG_IDS, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "truncate_prompt_tokens": 12})
    assert got.usage.prompt_tokens == 12
    plps = got.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == 12 and plps[0] is None
    ref = offline.generate(prompt_token_ids=[LONG_IDS[-12:]], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    for tok, entry, want in zip(LONG_IDS[-11:], plps[1:], ref[0].prompt_logprobs[1:]):
        mine = entry[str(tok)]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-4) and mine["rank"] >= 1
        assert sorted(r["rank"] for r in entry.values())[:2] == [1, 2]       # the top 2, and the token's own
    both = client.completions.create(model=model_of(client), prompt=LONG_IDS[:8], max_tokens=1, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 3}).choices[0]
    assert all(len(top) == 1 for top in both.logprobs.top_logprobs[1:])              # echo: logprobs=1 as asked
    assert all(len(e) >= 3 for e in both.model_extra["prompt_logprobs"][1:])        # prompt_logprobs: 3
    text = client.completions.create(model=model_of(client), prompt=LONG_IDS[:5], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[4:7]
    kept = client.completions.create(model=model_of(client), prompt=LONG_IDS[:5], max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.find(stop) + 3]


def test_chat_template_controls_echo_and_ignored_fields(client, server, offline):
    convo = MSG + [{"role": "assistant", "content": "The colour is"}]
    got = client.chat.completions.create(
        model=model_of(client), messages=convo, max_tokens=6, temperature=0, audio=None, reasoning_effort="low",
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True,
                    "chat_template_kwargs": {"enable_thinking": False}, "frobnicate": 1, "stream_options": None})
    prompt = offline.engine.tok.chat_prompt(convo, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("The colour is")
    ref = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert got.choices[0].message.content == "The colour is" + ref[0].outputs[0].text
    client.completions.create(model=model_of(client), prompt="hi", max_tokens=1, extra_body={"frobnicate": 2})
    assert server.log_path.read_text().count("'frobnicate'") == 1          # one warning line per field name
    for body, param in [({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                        ({"modalities": ["text", "audio"]}, "modalities"),
                        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                        ({"chat_template": "{{ messages }}"}, "chat_template"),
                        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                        ({"prompt_logprobs": 21}, "prompt_logprobs")]:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "logit_bias": {"x": 1}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    far = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "logit_bias": {"99999": 1}}, timeout=30)
    assert far.status_code == 400 and "vocabulary" in far.json()["error"]["message"]


def test_continuous_usage_stats(server):
    body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and usages[-1]["completion_tokens"] == 6
    assert usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + 6


def test_chat_stream_echoes_the_final_message(server):
    body = {"messages": MSG + [{"role": "assistant", "content": "Blue"}], "max_tokens": 3, "stream": True,
            "echo": True, "add_generation_prompt": False, "continue_final_message": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Blue"}


def test_utility_endpoints(server, offline):
    tok = offline.engine.tok
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0 and len(r["token_strs"]) == r["count"]
    chat = httpx.post(server.url + "/tokenize", json={"messages": MSG}).json()
    assert chat["tokens"] == tok.tokenizer.encode(tok.chat_prompt(MSG), add_special_tokens=False)
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": tok.decode(r["tokens"], skip_special_tokens=False)}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={}).status_code == 400
    version = httpx.get(server.url + "/version").json()["version"]
    assert version and version[0].isdigit()
    ping = httpx.get(server.url + "/ping")
    assert ping.status_code == 200 and ping.content == b""
    assert httpx.post(server.url + "/ping").status_code == 200


def _cached(url: str, salt: str | None = None, headers=None) -> int:
    sp = {"max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
    r = httpx.post(url + "/generate", json={"input_ids": LONG_IDS, "sampling_params": sp}, headers=headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["num_cached_tokens"]


def test_cache_salt_through_the_server(server):
    _cached(server.url, "victim")
    assert _cached(server.url, "victim") == 32                    # its own salt: cached
    assert _cached(server.url, "prober") == 0                     # another salt: nothing to learn
    assert _cached(server.url) == 0                               # no salt: not the salted blocks either
    r = httpx.post(server.url + "/v1/completions", json={"prompt": LONG_IDS, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_rebinding_host_is_refused(server):
    port = server.port
    for path in ("/v1/models", "/health", "/metrics", "/ping"):
        r = httpx.get(server.url + path, headers={"Host": f"attacker.example:{port}"})
        assert r.status_code == 421, (path, r.status_code)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   headers={"Host": f"attacker.example:{port}"})
    assert r.status_code == 421
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200


@pytest.mark.slow
def test_per_api_key_isolation_hosts_and_request_templates(tenant_server):
    url = tenant_server.url
    a, b = ({"Authorization": f"Bearer key-{k}"} for k in "ab")
    _cached(url, headers=a)
    assert _cached(url, headers=a) == 32                          # a tenant's own requests share its cache
    assert _cached(url, headers=b) == 0                           # another key's do not
    _cached(url, "shared-name", headers=a)
    assert _cached(url, "shared-name", headers=b) == 0            # not even under a salt both name
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-c"}).status_code == 401
    assert httpx.get(url + "/health", headers={"Host": "proxy.example"}).status_code == 200
    assert httpx.get(url + "/health", headers={"Host": "other.example"}).status_code == 421
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    r = httpx.post(url + "/tokenize", headers=a, json={"messages": MSG, "chat_template": template,
                                                       "chat_template_kwargs": {"greeting": "HELLO"}})
    assert r.status_code == 200, r.text
    text = httpx.post(url + "/detokenize", headers=a, json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.replace(" ", "") == "HELLO|Nameacolour."
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
