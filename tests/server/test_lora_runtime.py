"""vLLM's runtime LoRA endpoints through a real `stagewise serve --enable-lora-runtime-updates`: a
loaded adapter shows in /v1/models at once and its greedy tokens equal PEFT's merged model (every
pipeline stage holds it: PP=1 and PP=2); each refusal is one sentence in the OpenAI error shape;
an unloaded adapter is gone; without the flag the endpoints say how to turn them on."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("peft")
from lora_adapters import NEW_TOKENS, make_adapters, merged_greedy  # noqa: E402

pytestmark = pytest.mark.slow

IDS = [(7 * i + 3) % 900 + 10 for i in range(17)]


def _error(resp: httpx.Response, status: int, match: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert match in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def _greedy(http: httpx.Client, model: str) -> list[int]:
    resp = http.post("/v1/completions", json={"model": model, "prompt": IDS, "max_tokens": NEW_TOKENS,
                                              "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                              "return_tokens_as_token_ids": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == model
    return [int(t.split(":")[1]) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


@pytest.mark.parametrize("pp", [1, 2])
def test_load_and_unload_at_run_time(llama_dir, tmp_path, launch, pp):
    adapters = make_adapters(llama_dir, tmp_path / "adapters")     # attn: rank 4, mlp: rank 8
    server = launch(llama_dir, tmp_path, "--enable-lora-runtime-updates", "--max-lora-rank", "4",
                    "--max-loras", "1", "--pp-size", str(pp))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            def models() -> dict[str, dict]:
                return {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            base = next(iter(models()))
            assert list(models()) == [base]
            resp = http.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": adapters["attn"]})
            assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'attn' added successfully."
            assert models()["attn"]["parent"] == base
            assert _greedy(http, "attn") == merged_greedy(llama_dir, adapters["attn"], IDS)[0]
            assert _greedy(http, base) == merged_greedy(llama_dir, None, IDS)[0]

            load = "/v1/load_lora_adapter"
            _error(http.post(load, json={"lora_name": "attn", "lora_path": adapters["attn"]}), 400, "already loaded")
            _error(http.post(load, json={"lora_name": "again", "lora_path": adapters["attn"]}), 400, "--max-loras")
            _error(http.post(load, json={"lora_name": base, "lora_path": adapters["attn"]}), 400, "base model's name")
            _error(http.post(load, json={"lora_name": "x"}), 400, "lora_path")
            _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "'nope' is not loaded")
            resp = http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
            assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'attn' removed successfully."
            assert list(models()) == [base]
            _error(http.post("/v1/completions", json={"model": "attn", "prompt": IDS, "max_tokens": 2}), 404,
                   "'attn' does not exist")
            _error(http.post(load, json={"lora_name": "mlp", "lora_path": adapters["mlp"]}), 400,
                   "rank 8, above --max-lora-rank 4")
            _error(http.post(load, json={"lora_name": "gone", "lora_path": str(tmp_path / "none")}), 400,
                   "does not exist")
            _error(http.post(load, json={"lora_name": "dir", "lora_path": str(tmp_path)}), 400,
                   "has no adapter_config.json")
            assert list(models()) == [base]
    finally:
        server.stop()


def test_endpoints_off_without_the_flag(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            _error(http.post(path, json={"lora_name": "a", "lora_path": "/x"}), 404, "--enable-lora-runtime-updates")
