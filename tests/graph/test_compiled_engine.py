"""The compiled CPU stage body through the whole engine: greedy fp32 tokens equal the one-stage
eager run (PP=1 and PP=2, chunked prefill, prefix-cache hits, embedding prompts, batched decode),
every step replays at its own size (steps of up to 8 tokens on the few-rows decode graph, larger
ones on the prefill graph), the same holds when the graphs compile in the background while the
first steps run eager, and a second start reuses Inductor's on-disk cache.

The suite's compile-heavy module: one tiny model, compiled once per process and configuration.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from stagewise import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SHARED = [(7 * i) % 800 + 5 for i in range(40)]
PROMPTS = [SHARED + [11, 12, 13], list(range(10, 31)), [5], SHARED + [99]]   # the last hits the prefix cache
OPTIONS = dict(chunked_prefill_size=32, enable_prefix_caching=True, dtype="float32", decode_graph_max_bs=8)
COMPILED = dict(OPTIONS, prefill_graph="compiled", compile_in_background=False)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("inductor")
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _embeds(model_dir, ids):
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")[torch.tensor(ids)]


def _run(llm, model_dir):
    """Batched prompts (the last one after the others, so its prefix is cached), then an embedding prompt."""
    first = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=GREEDY, use_tqdm=False)
    second = llm.generate(prompt_token_ids=PROMPTS[3:], sampling_params=GREEDY, use_tqdm=False)
    embeds = llm.generate(input_embeds=[_embeds(model_dir, PROMPTS[1])], sampling_params=GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + second + embeds], second[0].num_cached_tokens


@pytest.fixture(scope="module")
def eager_tokens(llama_dir):
    with LLM(model=str(llama_dir), prefill_graph="off", **OPTIONS) as llm:
        return _run(llm, llama_dir)[0]


@pytest.mark.slow
def test_compiled_equals_eager_one_stage(llama_dir, cache_dir, eager_tokens):
    with LLM(model=str(llama_dir), **COMPILED) as llm:
        got, cached = _run(llm, llama_dir)
        prefill, decode = llm.stats()["prefill_graph"], llm.stats()["decode_graph"]
        runner = llm.engine.executor.worker.runner
        stage_eager = runner.stats()["eager"], runner.stats("decode")["eager"]
    assert got == eager_tokens
    assert got[1] == got[4]                        # the embedding prompt gives its ids' tokens
    assert cached > 0                              # the fourth prompt did hit the prefix cache
    assert prefill["backend"] == decode["backend"] == "compiled" and not prefill["eager"] and not decode["eager"]
    assert 32 in prefill["replays"] and {1, 3} <= set(decode["replays"])   # each step at its own size
    assert max(decode["replays"]) <= 8 < min(prefill["replays"])
    assert prefill["padded_tokens"] == decode["padded_tokens"] == 0
    assert stage_eager == ({}, {})                 # the stage replayed every step it was told to
    # NOTE: whether Inductor writes to `cache_dir` here depends on what this process compiled before
    # (an earlier module's compile of the same graph is reused from memory); the on-disk cache is
    # checked in fresh processes below.


@pytest.mark.slow
def test_second_start_hits_the_compile_cache(llama_dir, tmp_path):
    """Two fresh processes compile the same model: the first fills the cache (under
    `$STAGEWISE_CACHE/inductor`), the second finds its graph there."""
    code = (
        "import json, torch._dynamo.utils as u\n"
        "from stagewise import LLM, SamplingParams\n"
        f"llm = LLM(model={str(llama_dir)!r}, **{COMPILED!r})\n"
        "llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print(json.dumps(dict(u.counters['inductor'])))\n")
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, "STAGEWISE_CACHE": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold.get("fxgraph_cache_miss", 0) >= 1 and cold.get("fxgraph_cache_hit", 0) == 0, cold
    assert warm.get("fxgraph_cache_hit", 0) >= 1 and warm.get("fxgraph_cache_miss", 0) == 0, warm
    assert any((tmp_path / "inductor" / "fxgraph").iterdir())       # under $STAGEWISE_CACHE, as documented


@pytest.mark.slow
def test_compiled_pipeline_equals_one_stage_eager(llama_dir, cache_dir, eager_tokens):
    with LLM(model=str(llama_dir), pp_size=2, **COMPILED) as llm:
        got, _ = _run(llm, llama_dir)
        prefill, decode = llm.stats()["prefill_graph"], llm.stats()["decode_graph"]
    assert got == eager_tokens
    for stats in (prefill, decode):
        assert stats["backend"] == "compiled" and sum(stats["replays"].values()) > 0 and not stats["eager"]


@pytest.mark.slow
def test_background_compile_gives_the_eager_tokens(llama_dir, cache_dir, eager_tokens):
    """The default: the engine serves at once, eagerly, and switches to each graph once compiled. Two
    threads: the tiny model's decode steps then run on one (runtime/team.py), so prefill and decode
    steps alternate thread counts, which the compiled graphs are guarded on."""
    with LLM(model=str(llama_dir), prefill_graph="compiled", threads_per_stage=2, **OPTIONS) as llm:
        runner = llm.engine.executor.worker.runner
        assert llm.engine.executor.worker.team.decode == 1 and runner.decode_threads == 1
        early, _ = _run(llm, llama_dir)                # whatever mix of eager and compiled steps this was
        assert runner.wait_compiled(600)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        late, _ = _run(llm, llama_dir)                 # every step compiled now
        prefill, decode = runner.stats(), runner.stats("decode")
        # the steps run what the background compiled: nothing compiles again on the serving thread
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert early == late == eager_tokens
    assert prefill["replays"] and decode["replays"]
