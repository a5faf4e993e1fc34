"""Failure isolation through the real engine, at one stage and across stage processes: a request
whose rows turn non-finite fails alone, a plan whose forward raises fails only its requests, their
KV blocks go back to the free pool (and are safe to reuse), and the engine serves on."""
import json
import shutil
import time

import pytest

from stagewise import LLM, SamplingParams, register_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
NORMAL = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 101, 102, 103, 104, 105, 106]]


@pytest.fixture(scope="module")
def faulty_dir(llama_dir, tmp_path_factory):
    from faulty_model import FaultyLlamaForCausalLM
    path = tmp_path_factory.mktemp("faulty") / "model"
    shutil.copytree(llama_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FaultyLlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    register_model("FaultyLlamaForCausalLM", FaultyLlamaForCausalLM)
    return path


@pytest.fixture(scope="module")
def reference(llama_dir):
    with LLM(model=str(llama_dir)) as llm:
        outs = llm.generate(prompt_token_ids=NORMAL * 4, sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run(llm, prompts):
    return llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)


@pytest.mark.parametrize("pp_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_one_request_fails_alone_and_its_blocks_are_reusable(faulty_dir, reference, pp_size):
    from faulty_model import NAN_TOKEN, RAISE_TOKEN
    # a small cache (32 blocks of 16 tokens, 8 KiB each) so later requests reuse the failed request's blocks
    with LLM(model=str(faulty_dir), pp_size=pp_size, kv_cache_memory=32 * 8192,
             enable_prefix_caching=False) as llm:
        assert llm.stats()["num_kv_blocks"] <= 40
        poisoned = [1, 2, 3] + [NAN_TOKEN] + list(range(10, 50))
        outs = run(llm, [NORMAL[0], poisoned, NORMAL[1]])
        assert outs[1].outputs[0].finish_reason == "error" and "non-finite" in outs[1].outputs[0].error
        assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [reference[0], reference[1]]
        assert llm.stats()["kv_usage"] == 0.0
        # the whole plan fails when its forward raises; nothing else is lost
        outs = run(llm, [NORMAL[2], [7, RAISE_TOKEN, 8]])
        assert all(o.outputs[0].finish_reason == "error" for o in outs)
        assert "injected fault" in outs[1].outputs[0].error
        assert llm.stats()["kv_usage"] == 0.0
        # later requests cycle through every block, the poisoned ones included
        outs = run(llm, NORMAL * 4)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert llm.engine.fault() is None


def test_bad_partition_is_refused_before_any_stage_starts(llama_dir):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="partition"):
        LLM(model=str(llama_dir), pp_size=2, pp_layer_partition=[2, 1])
    assert time.monotonic() - t0 < 10


def test_colliding_block_hashes_never_share_kv(llama_dir, monkeypatch):
    from stagewise.kvcache import block_manager
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: b"same")
    prompts = [list(range(200, 240)), list(range(300, 340)), list(range(200, 240))]
    with LLM(model=str(llama_dir), block_size=16) as llm:
        outs = [run(llm, [p])[0] for p in prompts]
    with LLM(model=str(llama_dir), enable_prefix_caching=False) as llm:
        ref = [o.outputs[0].token_ids for o in run(llm, prompts)]
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.num_cached_tokens for o in outs] == [0, 0, 16]    # only the truly equal first block is shared
