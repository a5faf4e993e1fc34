"""`stagewise serve` on a Qwen3.5 checkpoint (linear-attention layers with a recurrent state per
request) at PP=2, split between the linear and the full-attention layers: a chat through the openai
client answers as the offline engine does, two at once."""
from __future__ import annotations

import pytest

from stagewise import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_chat_through_the_openai_client_matches_offline(qwen3_5_dir, launch, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "Tell me a story about a fox"}]]
    server = launch(qwen3_5_dir, tmp_path, "--pp-size", "2", "--pp-layer-partition", "3,1")
    try:
        with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            model = client.models.list().data[0].id
            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda m: client.chat.completions.create(
                    model=model, messages=m, max_tokens=12, temperature=0).choices[0].message.content, chats))
    finally:
        server.stop()
    with LLM(model=str(qwen3_5_dir)) as offline:
        want = [offline.chat(m, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text for m in chats]
    assert got == want and all(got)
