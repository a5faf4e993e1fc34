"""Images through a real `stagewise serve` with the `openai` client: data-URL image parts (one or several
per message) answer what transformers' generate answers on the same image; /tokenize counts image tokens;
hostile images (corrupt, bombs, oversized, too many, remote URLs) are each a 400 naming the part, and the
server keeps serving."""
from __future__ import annotations

import pytest
from mm_helpers import data_url, hf_idefics3_greedy, hf_llava_greedy, make_image, png_bomb, raw_data_url

from benchmarks.server_process import ServerProcess

LIMITS = ("--max-images-per-request", "2", "--max-image-pixels", "100000", "--max-image-bytes", "200000")


def _serve(model_dir, tmp, *args):
    srv = ServerProcess(model_dir, tmp / "server.log", "--dtype", "float32", "--prefill-graph", "off",
                        "--served-model-name", "m", *LIMITS, *args)
    try:
        srv.wait_healthy(180.0)
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def llava_server(llava_dir, tmp_path_factory):
    srv = _serve(llava_dir, tmp_path_factory.mktemp("llava-server"))
    yield srv
    srv.stop()


def _client(srv):
    from openai import OpenAI
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def _parts(*images, text="what is this? "):
    return [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in images]


def _ask(client, content, max_tokens=6):
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})


def _expected_text(llava_dir, content, images, max_tokens=6):
    from stagewise.engine.inputs import Tokenizer
    from stagewise.multimodal.encoder import VisionEncoder
    tok, enc = Tokenizer(str(llava_dir)), VisionEncoder(llava_dir)
    prompt = enc.chat(tok, [{"role": "user", "content": content}])
    ids = hf_llava_greedy(llava_dir, prompt.token_ids, enc.pixel_values(images), max_tokens)
    return tok.decode(ids), len(prompt.token_ids)


@pytest.mark.slow
def test_image_chat_equals_transformers(llava_server, llava_dir):
    import httpx
    one, two = make_image(0), make_image(5, (40, 70))
    with _client(llava_server) as client:
        for images in ([one], [one, two]):
            content = _parts(*(data_url(im) for im in images))
            want, num_tokens = _expected_text(llava_dir, content, images)
            got = _ask(client, content)
            assert got.choices[0].message.content == want
            assert got.usage.prompt_tokens == num_tokens
            counted = httpx.post(llava_server.url + "/tokenize", json={"model": "m", "messages": [
                {"role": "user", "content": content}], "add_special_tokens": True}, timeout=30).json()
            assert counted["count"] == num_tokens and num_tokens > 16 * len(images)


HOSTILE = [
    ([raw_data_url(b"\x89PNG\r\n\x1a\n garbage")], "messages.0.content.1", "corrupt or truncated"),
    ([raw_data_url(b"%PDF-1.7 not an image")], "messages.0.content.1", "could not be decoded"),
    ([raw_data_url(png_bomb(60_000, 60_000))], "messages.0.content.1", "decompression bomb"),
    ([raw_data_url(png_bomb(1_000, 1_000))], "messages.0.content.1", "over the limit of 100000"),
    (["data:image/png;base64," + "A" * 300_000], "messages.0.content.1", "over the limit of 200000"),
    (["https://example.com/cat.png"], "messages.0.content.1", "--allowed-image-hosts"),
    (["data:text/html;base64,PGI+"], "messages.0.content.1", "base64 image data URL"),
    ([data_url(make_image(1, (8, 8)))] * 3, "messages", "3 images, over the limit of 2"),
]


@pytest.mark.slow
def test_hostile_images_are_400s_naming_the_part_and_the_server_keeps_serving(llava_server):
    import openai
    with _client(llava_server) as client:
        for urls, param, says in HOSTILE:
            with pytest.raises(openai.BadRequestError) as err:
                _ask(client, _parts(*urls))
            body = err.value.body
            assert body["param"] == param and says in body["message"], body
        ok = _ask(client, _parts(data_url(make_image(0))))
        assert ok.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_text_only_model_refuses_images_with_one_sentence(llama_dir, tmp_path):
    import openai
    srv = _serve(llama_dir, tmp_path)
    try:
        with _client(srv) as client, pytest.raises(openai.BadRequestError, match="takes no images"):
            _ask(client, _parts(data_url(make_image(0))))
    finally:
        srv.stop()


@pytest.mark.slow
def test_image_chat_through_a_two_stage_pipeline_with_graphs(llava_dir, tmp_path):
    """PP=2 with prefill graphs on (the image prompt's chunks replay with their live embeddings)."""
    srv = _serve(llava_dir, tmp_path, "--pp-size", "2", "--prefill-graph", "breakable",
                 "--prefill-graph-buckets", "8,16,32", "--chunked-prefill-size", "16")
    try:
        content = _parts(data_url(make_image(2)))
        want, _ = _expected_text(llava_dir, content, [make_image(2)])
        with _client(srv) as client:
            assert _ask(client, content).choices[0].message.content == want
    finally:
        srv.stop()


@pytest.mark.slow
def test_idefics3_through_a_two_stage_pipeline_server(idefics3_dir, tmp_path):
    """The second family (SmolVLM's architecture) at PP=2 with prefill graphs: two images in one message."""
    import httpx

    from stagewise.engine.inputs import Tokenizer
    from stagewise.multimodal.families import vision_encoder
    srv = _serve(idefics3_dir, tmp_path, "--pp-size", "2", "--prefill-graph", "breakable",
                 "--prefill-graph-buckets", "8,16,32", "--chunked-prefill-size", "8")
    try:
        images = [make_image(3), make_image(4, (90, 30))]
        content = _parts(*(data_url(im) for im in images))
        tok, enc = Tokenizer(str(idefics3_dir)), vision_encoder(idefics3_dir)
        batch = enc.processed(tok, [{"role": "user", "content": content}])
        want = tok.decode(hf_idefics3_greedy(idefics3_dir, batch, 6))
        with _client(srv) as client:
            got = _ask(client, content)
        assert got.choices[0].message.content == want and got.usage.prompt_tokens == batch["input_ids"].shape[1]
        counted = httpx.post(srv.url + "/tokenize", json={"model": "m", "messages": [
            {"role": "user", "content": content}], "add_special_tokens": True}, timeout=30).json()
        assert counted["count"] == batch["input_ids"].shape[1]
    finally:
        srv.stop()
