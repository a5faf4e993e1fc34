"""The driver's engine options reach every node: a node started with other engine flags runs its
stages with the driver's (and says which of its own differ), while what is its own stays."""
import os
import subprocess
import sys

import pytest

from stagewise import LLM, SamplingParams
from stagewise.cluster.node_options import adopt_options, shipped_options
from stagewise.cluster.rendezvous import free_port
from stagewise.config import EngineConfig

PROMPT = "Hello there, how are you today"


def test_a_node_takes_the_drivers_engine_options_and_keeps_its_own(caplog):
    driver = EngineConfig.from_kwargs(model="/a/model", prefill_graph="breakable", block_size=8, pp_size=2,
                                      nnodes=2, master_port=29500, threads_per_stage=4, pp_layer_partition="3,1",
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                                      dist_ifname="eth0")
    node = EngineConfig.from_kwargs(model="/b/model", pp_size=2, nnodes=2, node_rank=1, master_port=29500,
                                    threads_per_stage=1, dist_ifname="eth1")
    told: set[str] = set()
    got = adopt_options(node, shipped_options(driver), told)
    assert got.graphs == driver.graphs and got.cache.block_size == 8
    assert got.parallel.pp_layer_partition == (3, 1) and got.scheduler.speculative_config == \
        driver.scheduler.speculative_config
    assert (got.load.model, got.cluster.node_rank, got.parallel.threads_per_stage, got.cluster.dist_ifname) == \
        ("/b/model", 1, 1, "eth1")
    assert "--block-size 8 (here: 16)" in caplog.text and "--prefill-graph breakable (here: auto)" in caplog.text
    assert "threads" not in caplog.text and "partition" not in caplog.text
    caplog.clear()
    assert adopt_options(got, shipped_options(driver), told) == got and not caplog.text    # said once
    assert adopt_options(node, None) is node       # a driver that ships none: the node's own
    with pytest.raises(ValueError, match="Node 1 cannot run the driver's engine options .*same stagewise version"):
        adopt_options(node, '{"block_size": 8, "an_option_of_a_newer_version": 1}')


@pytest.mark.slow
def test_nodes_started_with_other_flags_run_the_drivers(llama_dir):
    """Node 0 with prefill graphs and a block size of its own, node 1 with neither: every request
    used to fail in stage 1 (a graph verdict for a bucket it never captured)."""
    port = free_port()
    common = ["--model", str(llama_dir), "--pp-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--dist-timeout-s", "60", "--no-pipeline-spares"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    worker = subprocess.Popen([sys.executable, "-m", "stagewise", "--log-level", "WARNING", "generate", *common,
                               "--node-rank", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        driver = subprocess.run([sys.executable, "-m", "stagewise", "--log-level", "WARNING", "generate", *common,
                                 "--node-rank", "0", "--prefill-graph", "breakable", "--prefill-graph-max-tokens",
                                 "64", "--block-size", "8", "--prompt", PROMPT, "--no-chat", "--max-tokens", "8",
                                 "--ignore-eos"], env=env, capture_output=True, text=True, timeout=240)
        worker_out, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert driver.returncode == 0, driver.stderr[-2000:]
    assert worker.returncode == 0, worker_out[-2000:]
    assert "its own command line differs in --block-size 8 (here: 16); --prefill-graph breakable (here: auto)" \
        in worker_out
    with LLM(model=str(llama_dir)) as llm:
        want = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert driver.stdout.strip() == (PROMPT + want[0].outputs[0].text).strip()
