"""`stagewise serve`'s HTTP front process never loads torch for a GGUF text model (it parses, tokenizes
and streams; the engine process below it runs the model): ~110 MB resident instead of ~300 MB. (A
checkpoint directory's config and tokenizer come from transformers, which loads torch.)"""
from __future__ import annotations

from pathlib import Path

import httpx

from stagewise.model.source import ensure_default_model


def _has_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_the_http_front_process_does_not_load_torch(launch, tmp_path):
    server = launch(ensure_default_model(), tmp_path)
    try:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True},
                          timeout=60).status_code == 200
        assert not _has_torch(server.proc.pid), "the HTTP front process loaded torch"
        assert any(_has_torch(pid) for pid in server.descendants()), "no engine process below the front runs torch"
    finally:
        server.stop()
