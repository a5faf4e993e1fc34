"""LoRA adapters (PEFT format) per request: each request's greedy tokens and logprobs equal PEFT's
merged-weights model (fp32), in one batch that mixes the base model and two adapters; the prefix
cache never shares blocks across adapters; bad adapters and unknown names are one sentence."""
import json
import shutil

import pytest

from stagewise import LLM, SamplingParams

pytest.importorskip("peft")
from lora_adapters import ADAPTERS, NEW_TOKENS, make_adapters, merged_greedy  # noqa: E402

PROMPTS = [[(7 * i + 3) % 900 + 10 for i in range(21)], [(5 * i + 1) % 900 + 10 for i in range(9)],
           [(3 * i + 2) % 900 + 10 for i in range(13)]]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, str]:
    return make_adapters(llama_dir, tmp_path_factory.mktemp("lora"))


def _check(outs, llama_dir, adapters, names):
    for out, ids, name in zip(outs, PROMPTS * 3, names):
        want, logp = merged_greedy(llama_dir, None if name is None else adapters[name], ids)
        comp = out.outputs[0]
        assert comp.token_ids == want, name
        assert comp.logprobs[0].token_id == want[0]
        got = comp.logprobs[0].logprob
        assert abs(got - float(logp[want[0]])) < 1e-4, (name, got, float(logp[want[0]]))


def test_mixed_batch_equals_peft_merged(llama_dir, adapters):
    names = [None, "attn", "mlp", "mlp", None, "attn"]
    prompts = PROMPTS + PROMPTS
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(model=str(llama_dir), lora_modules=[f"{k}={v}" for k, v in adapters.items()]) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=names, use_tqdm=False)
        _check(outs, llama_dir, adapters, names)
        # the adapters matter: each changes some prompt's tokens from the base model's
        for name in ADAPTERS:
            assert any(merged_greedy(llama_dir, adapters[name], ids)[0] != merged_greedy(llama_dir, None, ids)[0]
                       for ids in PROMPTS), name
        # the same prompt under the other adapter: the prefix cache must not hand it the first one's KV
        again = llm.generate(prompt_token_ids=prompts, sampling_params=params,
                             lora_request=[None, "mlp", "attn", "attn", "mlp", None], use_tqdm=False)
        _check(again, llama_dir, adapters, [None, "mlp", "attn", "attn", "mlp", None])
        # a 40-token prompt (two full blocks): cached for its own adapter only
        long = [[(11 * i + 5) % 900 + 10 for i in range(40)]]
        cached = [llm.generate(prompt_token_ids=long, sampling_params=params, lora_request=name,
                               use_tqdm=False)[0].num_cached_tokens for name in ("attn", "mlp", None, "mlp", "attn")]
        assert cached == [0, 0, 0, 32, 32]
        with pytest.raises(ValueError, match="'nope' is not loaded"):
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, lora_request="nope")


def test_prefix_cache_keys_on_adapter():
    from stagewise.kvcache.block_manager import salt_root
    from stagewise.request import Request

    def root(**kw):
        return salt_root(Request("r", [1, 2, 3], SamplingParams(**kw)))
    roots = [root(), root(lora="a"), root(lora="b"), root(cache_salt="a"), root(cache_salt="a", lora="a")]
    assert roots[0] is None
    assert len({r for r in roots}) == len(roots)


@pytest.mark.slow
def test_two_stages(llama_dir, adapters):
    names = ["mlp", None, "attn"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(model=str(llama_dir), pp_size=2, lora_modules=[f"{k}={v}" for k, v in adapters.items()]) as llm:
        _check(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=names, use_tqdm=False),
               llama_dir, adapters, names)


@pytest.mark.slow
def test_tensor_parallel(llama_dir, adapters):
    """TP=2: each rank adds its rows of B (its q/k/v heads, its share of gate/up and of the gathered
    o/down rows) over the whole A; equal to PEFT's merged model, as TP=1 is. An adapter loaded at run
    time reaches both ranks."""
    names = ["mlp", None, "attn"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(model=str(llama_dir), tp_size=2, lora_modules=[f"mlp={adapters['mlp']}"],
             enable_lora_runtime_updates=True) as llm:
        llm.load_lora("attn", adapters["attn"])
        _check(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=names, use_tqdm=False),
               llama_dir, adapters, names)


def test_bad_adapters_refused_at_start(llama_dir, adapters, tmp_path):
    big = tmp_path / "big"
    shutil.copytree(adapters["mlp"], big)
    with pytest.raises(Exception, match="'big' has rank 8, above --max-lora-rank 4"):
        LLM(model=str(llama_dir), lora_modules=[f"big={big}"], max_lora_rank=4)
    odd = tmp_path / "odd"
    shutil.copytree(adapters["attn"], odd)
    cfg = json.loads((odd / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (odd / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="'odd' targets lm_head"):
        LLM(model=str(llama_dir), lora_modules=[f"odd={odd}"])
    with pytest.raises(ValueError, match="must be name=path"):
        LLM(model=str(llama_dir), lora_modules=["justapath"])


def test_lora_options_are_checked():
    from stagewise import EngineConfig
    config = EngineConfig.from_kwargs(lora_modules={"a": "/x", "b": "/y"})
    assert config.load.lora_modules == ("a=/x", "b=/y")
    assert EngineConfig.from_kwargs(**config.options()) == config
    with pytest.raises(ValueError, match="more than max_loras 1"):
        EngineConfig.from_kwargs(lora_modules=["a=/x", "b=/y"], max_loras=1)
    with pytest.raises(ValueError, match="names must be unique"):
        EngineConfig.from_kwargs(lora_modules=["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="LoRA adapters .* run eager"):
        EngineConfig.from_kwargs(lora_modules=["a=/x"], decode_graph=True)


def test_runtime_load_unload(llama_dir, adapters, tmp_path):
    """Adapters loaded while the engine runs (enable_lora_runtime_updates): equal to PEFT's merged model;
    an unload waits for no request (refused while one runs on it); a different adapter loaded again under
    the same name never gets the first one's prefix-cache blocks."""
    from stagewise.errors import LoraInUseError, LoraNotFoundError
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    long = [(11 * i + 5) % 900 + 10 for i in range(40)]     # two full blocks: cached after its first run
    with LLM(model=str(llama_dir), enable_lora_runtime_updates=True) as llm:
        assert llm.engine.lora_names == ()
        llm.load_lora("x", adapters["attn"])
        names = ["x", None, "x"]
        _check(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request=names, use_tqdm=False),
               llama_dir, {"x": adapters["attn"]}, names)
        first = llm.generate(prompt_token_ids=[long], sampling_params=params, lora_request="x", use_tqdm=False)[0]
        llm.engine.add_request(params=SamplingParams(max_tokens=2, lora="x"), prompt_token_ids=PROMPTS[0])
        with pytest.raises(LoraInUseError, match="'x' is in use by 1 unfinished request"):
            llm.unload_lora("x")
        list(llm.engine.run_until_done())
        llm.unload_lora("x")
        with pytest.raises(LoraNotFoundError, match="'x' is not loaded"):
            llm.unload_lora("x")
        with pytest.raises(ValueError, match="'x' is not loaded"):
            llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params, lora_request="x")
        llm.load_lora("x", adapters["mlp"])
        again = llm.generate(prompt_token_ids=[long], sampling_params=params, lora_request="x", use_tqdm=False)[0]
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0
        assert again.outputs[0].token_ids == merged_greedy(llama_dir, adapters["mlp"], long)[0]
        assert llm.generate(prompt_token_ids=[long], sampling_params=params, lora_request="x",
                            use_tqdm=False)[0].num_cached_tokens == 32
        with pytest.raises(ValueError, match="already loaded"):
            llm.load_lora("x", adapters["attn"])
    with LLM(model=str(llama_dir), lora_modules=[f"attn={adapters['attn']}"]) as llm:
        with pytest.raises(ValueError, match="--enable-lora-runtime-updates"):
            llm.load_lora("y", adapters["mlp"])
