"""Pipeline parallelism with real stage processes over their TCP links: token equivalence with PP=1,
micro-batching, faults (a killed stage), and a two-node launch simulated on localhost."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.errors import EngineDeadError

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 15)), [(7 * i) % 900 + 3 for i in range(37)], list(range(200, 221)), [5, 9, 11] * 6,
           list(range(300, 302)), list(range(400, 460))]
pytestmark = pytest.mark.slow


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def reference(model_dir):
    with LLM(model=str(model_dir), max_num_seqs=1, enable_prefix_caching=False) as llm:
        return tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def llama_ref(llama_dir):
    return reference(llama_dir)


@pytest.mark.parametrize("options", [
    dict(pp_size=2),
    dict(pp_size=3, pp_layer_partition="1,1,2", chunked_prefill_size=16, block_size=4),
    dict(pp_size=2, pp_depth=1, max_num_seqs=3),
    dict(pp_size=2, pp_depth=3, kv_cache_memory=26 * 2 * 2 * 4 * 2 * 16 * 4, block_size=4),   # preemption
])
def test_pp_matches_one_stage(llama_dir, llama_ref, options):
    with LLM(model=str(llama_dir), **options) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        stats = llm.stats()
    assert got == llama_ref
    assert len(stats["stage_busy_s"]) == options["pp_size"]
    if "kv_cache_memory" in options:
        assert stats["num_preemptions"] > 0


def test_pp_gpt2_hidden_only_contract_with_embeds_and_prefix_cache(gpt2_dir):
    from safetensors import safe_open
    with safe_open(str(gpt2_dir / "model.safetensors"), "pt") as f:
        wte = f.get_tensor("transformer.wte.weight")
    ref = reference(gpt2_dir)
    with LLM(model=str(gpt2_dir), pp_size=3, chunked_prefill_size=24, block_size=4) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        again = tokens(llm.generate(prompt_token_ids=PROMPTS[1:2], sampling_params=GREEDY, use_tqdm=False))
        by_embeds = tokens(llm.generate(input_embeds=[wte[torch.tensor(PROMPTS[0])]], sampling_params=GREEDY,
                                        use_tqdm=False))
        assert llm.stats()["prefix_cache_hit_rate"] > 0
    assert got == ref and again == ref[1:2] and by_embeds == ref[:1]


def test_killed_stage_fails_fast_and_leaves_no_process(llama_dir):
    """With recovery off (a healing pipeline: test_offline_recovery.py)."""
    llm = LLM(model=str(llama_dir), pp_size=2, dist_timeout_s=30, max_pipeline_restarts=0)
    procs = llm.engine.executor.procs
    victim = procs[1]
    llm.engine.add_request(prompt_token_ids=PROMPTS[5], params=SamplingParams(max_tokens=400, ignore_eos=True,
                                                                              temperature=0))
    llm.engine.step()
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="died|stage") as info:
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert time.monotonic() - t0 < 15
    assert info.value.outputs and info.value.outputs[0].outputs[0].finish_reason == "error"
    llm.shutdown()
    for p in procs:
        p.join(timeout=10)
        assert not p.is_alive()
    with pytest.raises(EngineDeadError):
        llm.generate(prompt_token_ids=[PROMPTS[0]], use_tqdm=False)


def test_idle_longer_than_timeout_survives_on_heartbeats(llama_dir):
    with LLM(model=str(llama_dir), pp_size=2, dist_timeout_s=4) as llm:
        first = tokens(llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False))
        time.sleep(9)
        assert tokens(llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False)) == first


def _free_port():
    from stagewise.cluster.rendezvous import free_port
    return free_port()


def test_two_nodes_on_localhost(llama_dir, llama_ref):
    port = _free_port()
    common = ["--model", str(llama_dir), "--pp-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--dist-timeout-s", "60"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    worker = subprocess.Popen([sys.executable, "-m", "stagewise", "generate", *common, "--node-rank", "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        driver = subprocess.run([sys.executable, "-m", "stagewise", "--log-level", "WARNING", "generate", *common,
                                 "--node-rank", "0", "--prompt", "Hello", "--no-chat", "--max-tokens", "8",
                                 "--ignore-eos"], env=env, capture_output=True, text=True, timeout=180)
        assert driver.returncode == 0, driver.stderr[-2000:]
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
    with LLM(model=str(llama_dir)) as llm:
        want = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert driver.stdout.strip() == ("Hello" + want[0].outputs[0].text).strip()


def test_torchrun_launch(llama_dir):
    port = _free_port()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                          str(port), "-m", "stagewise", "--log-level", "WARNING", "generate", "--model", str(llama_dir),
                          "--pp-size", "2", "--prompt", "Hello", "--no-chat", "--max-tokens", "8", "--ignore-eos"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    with LLM(model=str(llama_dir)) as llm:
        want = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out.stdout.strip() == ("Hello" + want[0].outputs[0].text).strip()
