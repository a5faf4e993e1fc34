"""/v1/embeddings through a real `stagewise serve` and the `openai` client: vectors equal to
transformers' last hidden state (after the final norm) at the last token, normalised, as floats and as
base64; usage and /metrics count the prompt tokens; bad input is a 400 in OpenAI's error shape."""
from __future__ import annotations

import base64

import numpy
import pytest
import torch

try:
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.slow

IDS = [[(7 * i + 3) % 900 + 10 for i in range(23)], [5, 6, 7]]


def hf_last_token(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0)


def test_openai_client_float_and_base64(server, llama_dir):
    from openai import OpenAI
    before = server.metric("stagewise_embedding_requests_total")
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        floats = client.embeddings.create(model=model, input=IDS, encoding_format="float")
        packed = client.embeddings.create(model=model, input=IDS, encoding_format="base64")
        text = client.embeddings.create(model=model, input="hello world")
    assert floats.object == "list" and floats.model == model
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, IDS))
    for i, ids in enumerate(IDS):
        want = hf_last_token(llama_dir, ids)
        assert floats.data[i].index == i
        assert torch.allclose(torch.tensor(floats.data[i].embedding), want, atol=1e-5)
        # asked for base64, the client hands the string over: decoded as it decodes its own (float32)
        raw = base64.b64decode(packed.data[i].embedding)
        assert torch.equal(torch.tensor(numpy.frombuffer(raw, dtype="float32")), torch.tensor(floats.data[i].embedding))
    # no encoding_format: the client asks for base64 and decodes it itself
    assert len(text.data) == 1 and len(text.data[0].embedding) == want.shape[0]
    assert abs(float(torch.tensor(text.data[0].embedding).norm()) - 1) < 1e-5
    assert server.metric("stagewise_embedding_requests_total") - before == 5
    assert server.metric("stagewise_embedding_prompt_tokens_total") >= 2 * sum(map(len, IDS))


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1] * 5000}, "input"),                  # longer than the context
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_a_400(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].count(". ") == 0 and error["message"].endswith(".")


def test_wrong_model_is_refused_as_the_other_endpoints_do(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "model": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
