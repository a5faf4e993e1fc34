"""LLaVA end to end offline: the stages load the text model of a LLaVA checkpoint, the driver's vision
encoder (transformers' CLIP tower and LLaVA projector with the checkpoint's weights) splices image
features into the prompt embeddings, and greedy tokens equal transformers' own generate on the same
weights and image at PP=1 and PP=2, with prefill graphs off and on."""
from __future__ import annotations

import pytest
import torch
from mm_helpers import data_url, hf_llava_greedy, make_image

from stagewise import LLM, SamplingParams
from stagewise.multimodal.encoder import VisionEncoder

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GRAPHS = dict(prefill_graph="breakable", prefill_graph_buckets="8,16,32,48", chunked_prefill_size=16)


def _chat(image, text="what is in this picture?"):
    return [{"role": "user", "content": [{"type": "text", "text": text + " "},
                                         {"type": "image_url", "image_url": {"url": data_url(image)}}]}]


def _oracle(llava_dir, llm, conv, max_new_tokens=6):
    enc = llm.vision_encoder()
    prompt = enc.chat(llm.engine.tok, conv)
    images = [make_image(0)] if len(prompt.image_hashes) == 1 else None
    assert images is not None
    return prompt, hf_llava_greedy(llava_dir, prompt.token_ids, enc.pixel_values(images), max_new_tokens)


def test_encoder_splices_features_at_image_tokens(llava_dir):
    from transformers import LlavaForConditionalGeneration
    enc = VisionEncoder(llava_dir)
    ids = [0, 7, enc.image_token_id, 9]
    prompt = enc.encode(ids, [make_image(0)])
    assert len(prompt.token_ids) == 3 + 16 and prompt.num_image_tokens == 16
    hf = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        feats = hf.model.get_image_features(enc.pixel_values([make_image(0)])).pooler_output[0]   # [16, H]
        text = hf.get_input_embeddings()(torch.tensor([0, 7, 9]))
    torch.testing.assert_close(prompt.input_embeds[2:18], feats)
    torch.testing.assert_close(prompt.input_embeds[[0, 1, 18]], text)


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True])
def test_llm_chat_with_image_equals_transformers_pp1(llava_dir, graphs):
    options = GRAPHS if graphs else dict(prefill_graph="off")
    with LLM(model=str(llava_dir), dtype="float32", **options) as llm:
        conv = _chat(make_image(0))
        prompt, want = _oracle(llava_dir, llm, conv)
        got = llm.chat(conv, GREEDY)[0].outputs[0].token_ids
        pil = llm.chat([{"role": "user", "content": [{"type": "text", "text": "what is in this picture? "},
                                                     {"type": "image", "image": make_image(0)}]}], GREEDY)
        text = llm.chat([{"role": "user", "content": "what is in this picture?"}], GREEDY)
        stats = llm.stats()["prefill_graph"]
    assert got == want and pil[0].outputs[0].token_ids == want
    assert text[0].outputs[0].token_ids != want          # the image changed the answer
    if graphs:     # 19+ prompt rows in chunks of 16: the image chunks replayed with their live embeddings
        assert stats["replays"], stats


@pytest.mark.slow
def test_different_images_never_share_kv(llava_dir):
    with LLM(model=str(llava_dir), dtype="float32", prefill_graph="off", enable_prefix_caching=True) as llm:
        a1 = llm.chat(_chat(make_image(0)), GREEDY)[0]
        b = llm.chat(_chat(make_image(1)), GREEDY)[0]
        a2 = llm.chat(_chat(make_image(0)), GREEDY)[0]
    assert b.num_cached_tokens == 0 and a2.num_cached_tokens == 0
    assert a1.outputs[0].token_ids == a2.outputs[0].token_ids != b.outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True])
def test_llm_chat_with_image_equals_transformers_pp2(llava_dir, graphs):
    options = GRAPHS if graphs else dict(prefill_graph="off")
    with LLM(model=str(llava_dir), dtype="float32", pp_size=2, **options) as llm:
        conv = _chat(make_image(0), "describe it")
        _, want = _oracle(llava_dir, llm, conv)
        got = llm.chat(conv, GREEDY)[0].outputs[0].token_ids
    assert got == want


@pytest.mark.parametrize("fixture", ["llava_dir", "llava_siglip_dir"])
def test_token_count_without_decoding_matches_the_features(fixture, request):
    enc = VisionEncoder(request.getfixturevalue(fixture))
    ids = [0, enc.image_token_id, 9]
    assert len(enc.expand(ids)) == len(enc.encode(ids, [make_image(0)]).token_ids) == 2 + enc.tokens_per_image


@pytest.mark.slow
def test_siglip_tower_equals_transformers(llava_siglip_dir):
    with LLM(model=str(llava_siglip_dir), dtype="float32", prefill_graph="off") as llm:
        conv = _chat(make_image(0))
        prompt, want = _oracle(llava_siglip_dir, llm, conv)
        got = llm.chat(conv, GREEDY)[0].outputs[0].token_ids
    assert prompt.num_image_tokens == 16 and got == want


def test_text_only_model_refuses_images_in_one_sentence(llama_dir):
    with pytest.raises(ValueError, match="not a vision-language checkpoint"):
        VisionEncoder(llama_dir)
