"""Idefics3 (SmolVLM's architecture), the second family: the checkpoint's processor expands each image,
the driver's tower + connector fill its rows, and greedy tokens equal transformers' generate on the
same weights and image at PP=1 and PP=2, with prefill graphs off and on."""
from __future__ import annotations

import pytest
from mm_helpers import data_url, hf_idefics3_greedy, make_image

from stagewise import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GRAPHS = dict(prefill_graph="breakable", prefill_graph_buckets="8,16,32", chunked_prefill_size=8)


def _chat(*images):
    return [{"role": "user", "content": [{"type": "text", "text": "what is this? "}] +
             [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]}]


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(prefill_graph="off"), dict(GRAPHS, pp_size=2)], ids=["pp1", "pp2-graphs"])
def test_idefics3_chat_equals_transformers(idefics3_dir, options):
    with LLM(model=str(idefics3_dir), dtype="float32", **options) as llm:
        enc = llm.vision_encoder()
        for images in ([make_image(0)], [make_image(1), make_image(2, (30, 90))]):
            conv = _chat(*images)
            prompt = enc.chat(llm.engine.tok, conv)
            batch = enc.processed(llm.engine.tok, conv)
            assert prompt.token_ids == batch["input_ids"][0].tolist() and prompt.num_image_tokens == 4 * len(images)
            assert enc.expand([t for t in llm.engine.tok.encode(llm.engine.tok.chat_prompt(
                [{"role": "user", "content": "what is this? " + "<image>" * len(images)}]))]) == prompt.token_ids
            want = hf_idefics3_greedy(idefics3_dir, batch, 6)
            assert llm.chat(conv, GREEDY)[0].outputs[0].token_ids == want
