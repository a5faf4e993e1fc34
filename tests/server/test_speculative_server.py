"""`stagewise serve --speculative-config`: a real server and the openai client; greedy completions equal
the offline engine without speculation, and /metrics shows the speculative counters."""
import re

import httpx
import pytest

from stagewise import SamplingParams

PROMPTS = [[5, 9, 11] * 6, list(range(10, 15)) * 3]


@pytest.mark.slow
def test_served_greedy_completions_equal_plain_decoding(llama_dir, tmp_path, launch, offline):
    from openai import OpenAI
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    srv = launch(llama_dir, tmp_path, "--speculative-config", spec)
    try:
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
            model = client.models.list().data[0].id
            got = [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text
                   for p in PROMPTS]
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    want = offline.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=24, temperature=0),
                            use_tqdm=False)
    assert got == [o.outputs[0].text for o in want]
    proposed = re.search(r"^stagewise_spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert proposed is not None and float(proposed.group(1)) > 0
    assert "stagewise_spec_decode_acceptance_rate" in metrics
    assert "stagewise_spec_decode_mean_accepted_length" in metrics
