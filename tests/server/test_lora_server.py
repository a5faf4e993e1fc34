"""LoRA adapters through a real `stagewise serve --lora-modules` and the `openai` client: the request's
`model` picks the adapter (greedy tokens equal PEFT's merged model), /v1/models lists each adapter with
the base model as its parent, and an unknown name is a 404 naming it."""
from __future__ import annotations

import pytest

pytest.importorskip("peft")
from lora_adapters import NEW_TOKENS, make_adapters, merged_greedy  # noqa: E402

pytestmark = pytest.mark.slow

IDS = [(7 * i + 3) % 900 + 10 for i in range(17)]


def test_adapter_chosen_by_model_name(llama_dir, tmp_path, launch):
    import openai
    adapters = make_adapters(llama_dir, tmp_path / "adapters")
    server = launch(llama_dir, tmp_path, "--lora-modules", *(f"{k}={v}" for k, v in adapters.items()))
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            cards = {m.id: m for m in client.models.list().data}
            base = next(i for i, m in cards.items() if i not in adapters)
            assert set(cards) == {base, *adapters}
            for name in adapters:
                assert cards[name].model_extra["parent"] == base
            for model, adapter in [(base, None), *((n, p) for n, p in adapters.items())]:
                want = merged_greedy(llama_dir, adapter, IDS)[0]
                got = client.completions.create(model=model, prompt=IDS, max_tokens=NEW_TOKENS, temperature=0,
                                                logprobs=0, extra_body={"ignore_eos": True,
                                                                        "return_tokens_as_token_ids": True})
                assert got.model == model
                tokens = [int(t.split(":")[1]) for t in got.choices[0].logprobs.tokens]
                assert tokens == want, model
            with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
                client.completions.create(model="nope", prompt=IDS, max_tokens=2)
    finally:
        server.stop()
