"""The engine behind `stagewise serve` runs in a process of its own, which dies with the server
(nothing is left behind even when the server is SIGKILLed)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
from launcher import wait_gone

from stagewise import SamplingParams

pytestmark = pytest.mark.slow

try:
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPTS = ["The quick brown fox", "Once upon a time"]


def _greedy(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_engine_process_dies_with_a_killed_server(launch, llama_dir, tmp_path, offline):
    server = launch(llama_dir, tmp_path)
    try:
        below = server.descendants()                  # the engine process (and multiprocessing's tracker)
        assert any(b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in below), below
        ref = offline.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert [_greedy(server.url, p) for p in PROMPTS] == [r.outputs[0].text for r in ref]
        server.proc.send_signal(signal.SIGKILL)       # no drain, no clean-up code runs in the server
        assert server.proc.wait(10) == -signal.SIGKILL
        assert wait_gone(below) == []                 # PDEATHSIG took the engine process down too
    finally:
        server.stop()

