"""The in-process engine client (core/client.py: InprocClient), the way the offline LLM reaches its
engine: a request is handed over as the server's client takes it (a PromptInput), a text prompt alone
is tokenized by the engine (so its output echoes the text), ids or embeddings go as they are, and a
bad one is refused by the engine's own checks, nothing queued."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stagewise.config import EngineConfig
from stagewise.core.client import InprocClient, PromptInput
from stagewise.grammar.limits import GrammarLimits
from stagewise.request import SamplingParams


class RecordingEngine:
    max_model_len, kv_capacity_tokens, model_dir = 64, 256, "/m"
    config = EngineConfig.from_kwargs(model="m")
    tok = SimpleNamespace(vocab_size=100)
    grammar_limits = GrammarLimits()

    def __init__(self):
        self.added, self.stopped = [], False

    def add_request(self, prompt=None, params=None, *, prompt_token_ids=None, input_embeds=None):
        if sum(x is not None for x in (prompt, prompt_token_ids, input_embeds)) != 1:
            raise ValueError("Give exactly one of prompt, prompt_token_ids or input_embeds per request.")
        self.added.append((prompt, prompt_token_ids, input_embeds, params))
        return SimpleNamespace(request_id=f"req-{len(self.added)}")

    def run_until_done(self):
        yield from ()

    def shutdown(self):
        self.stopped = True


def test_requests_reach_the_engine_as_the_server_client_takes_them():
    client = InprocClient(SimpleNamespace(), engine_factory=lambda config: RecordingEngine())
    assert (client.info.max_model_len, client.info.vocab_size, client.info.config_model) == (64, 100, "m")
    params = SamplingParams(max_tokens=3)
    embeds = torch.zeros(2, 4)
    assert client.submit(PromptInput(text="hi"), params) == "req-1"
    assert client.submit(PromptInput(prompt_token_ids=[1, 2], text="hi"), params) == "req-2"   # text: an echo
    assert client.submit(PromptInput(input_embeds=embeds), params) == "req-3"
    added = client.engine.added
    assert [a[:2] for a in added] == [("hi", None), (None, [1, 2]), (None, None)]
    assert added[2][2] is embeds and all(a[3] is params for a in added)
    with pytest.raises(ValueError, match="exactly one"):
        client.submit(PromptInput(), params)
    assert len(added) == 3 and list(client.outputs()) == []
    client.stop()
    assert client.engine.stopped
