"""Amplification: a response's prompt logprob entries are bounded by --max-logprob-entries (a 400
naming the limit and the flag), each prompt is scored once and its entries shared by its n choices
(whole bodies and streams), and a large scored answer leaves other users' requests their latency
and the HTTP process its memory."""
from __future__ import annotations

import json
import statistics
import threading
import time

import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

P = [3 + (i * 37) % 900 for i in range(480)]         # token ids inside the tiny vocabulary
PROMPTS = [P, P[1:], P[2:], P[3:]]
CAP = 100_000


@pytest.fixture(scope="module")
def capped(launch, llama_dir, tmp_path_factory):
    srv = launch(llama_dir, tmp_path_factory.mktemp("capped"), "--max-logprob-entries", str(CAP))
    yield srv
    srv.stop()


def post(srv, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json=dict(body, model=None), timeout=timeout)


@pytest.mark.parametrize("body", [
    {"prompt": PROMPTS, "prompt_logprobs": 20, "max_tokens": 1, "n": 16},
    {"prompt": PROMPTS, "echo": True, "logprobs": 20, "max_tokens": 1, "n": 16},
], ids=["prompt_logprobs", "echo"])
@pytest.mark.slow
def test_amplification_is_refused_naming_the_flag(capped, body):
    r = post(capped, body)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert "--max-logprob-entries" in message and str(CAP) in message and message.count(". ") == 0
    assert len(r.content) < 1000


@pytest.mark.slow
def test_chat_and_generate_are_capped_too(capped):
    long_text = " ".join(["river cat"] * 100)      # ~400 tokens: x 21 x n 16 would pass the cap
    r = httpx.post(capped.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": long_text}], "prompt_logprobs": 20, "max_tokens": 1,
        "n": 16})
    assert r.status_code == 200, r.text[:300]          # chat shows a prompt's entries once, whatever n
    assert r.json()["prompt_logprobs"] is not None
    r = httpx.post(capped.url + "/generate", timeout=60, json={
        "input_ids": P, "sampling_params": {"prompt_logprobs": 20, "max_tokens": 1}})
    assert r.status_code == 200, r.text[:300]


def test_choices_share_their_prompts_entries(server):
    body = {"prompt": [P[:40], P[5:30]], "echo": True, "logprobs": 3, "prompt_logprobs": 5, "max_tokens": 3,
            "n": 4, "temperature": 1.0, "seed": 7}
    choices = post(server, body).json()["choices"]
    single = [post(server, dict(body, prompt=p, n=1)).json()["choices"][0] for p in body["prompt"]]
    for i, choice in enumerate(choices):
        alone, k = single[i // 4], len(body["prompt"][i // 4])
        assert choice["prompt_logprobs"] == alone["prompt_logprobs"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert choice["logprobs"][key][:k] == alone["logprobs"][key][:k]
        assert len(choice["logprobs"]["tokens"]) == k + 3


def test_streamed_choices_get_their_prompts_entries(server):
    body = {"prompt": [P[:40], P[5:30]], "echo": True, "logprobs": 2, "prompt_logprobs": 2, "max_tokens": 4,
            "n": 3, "stream": True}
    whole = post(server, dict(body, stream=False, temperature=0)).json()["choices"]
    got: dict[int, dict] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, temperature=0), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    seen = got.setdefault(choice["index"], {"text": "", "tokens": []})
                    seen["text"] += choice["text"]
                    seen["tokens"] += (choice["logprobs"] or {}).get("tokens", [])
                    if "prompt_logprobs" in choice:
                        seen["prompt_logprobs"] = choice["prompt_logprobs"]
    assert sorted(got) == list(range(6))
    for i, choice in enumerate(whole):
        assert got[i]["text"] == choice["text"] and got[i]["tokens"] == choice["logprobs"]["tokens"]
        assert got[i]["prompt_logprobs"] == choice["prompt_logprobs"]


def _plain_latency(srv) -> float:
    t = time.perf_counter()
    r = post(srv, {"prompt": "river cat", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    return time.perf_counter() - t


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def test_large_scored_answer_leaves_others_their_latency(server):
    quiet = statistics.median(_plain_latency(server) for _ in range(8))
    before = _rss_mb(server.proc.pid)
    body = {"prompt": PROMPTS, "prompt_logprobs": 20, "echo": True, "logprobs": 20, "max_tokens": 1, "n": 12}
    result: dict = {}
    big = threading.Thread(target=lambda: result.update(r=post(server, body, 300)))
    big.start()
    during = []
    while big.is_alive() or len(during) < 3:
        during.append(_plain_latency(server))
    big.join()
    assert result["r"].status_code == 200 and len(result["r"].content) > 20e6
    assert statistics.median(during) <= 2 * quiet + 0.05, (quiet, during)
    assert _rss_mb(server.proc.pid) < before + 150
