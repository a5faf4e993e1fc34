"""Compiled graphs built in the background: steps run eager until the graph is ready, the switch
falls between steps (a compile that finishes while a step is in flight leaves that step eager),
every step gives the eager model's output, and the few-rows (decode) compile opens no OpenMP
parallel region where the prefill compile does."""
import threading

import pytest
import torch
from graph_toys import Step, clone_batch, fill_history, toy_pipeline

from stagewise.graph.compiled import CompiledBackend
from stagewise.graph.policy import GraphVerdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.parallel.proxy import ProxyTensors


def _runner(decode_graph=False):
    model, batch = toy_pipeline(2, 2)[1]          # a second stage: its body reads proxy buffers
    policy = resolve_graph_policy("compiled", buckets=[8], decode_graph=decode_graph, decode_graph_max_bs=4,
                                  device_type="cpu")
    return model, batch, StageGraphRunner(model, model.stage, policy, batch, torch.float32, "cpu")


def _step_matches_eager(model, batch, runner, seqs, seed):
    step = Step(seqs, seed=seed)
    fill_history([batch], seed=seed)
    ref = clone_batch(batch)
    ref.meta = step.meta
    gen = torch.Generator().manual_seed(seed)
    proxy = ProxyTensors({k: torch.randn(step.num_tokens, model.hidden_size, generator=gen) for k in model.proxy_keys})
    with torch.no_grad():
        want = model(None, step.positions, ref, pp_proxy_tensors=proxy)
    got = runner.forward(GraphVerdict("prefill", step.num_tokens), None, step.positions, step.meta, proxy=proxy)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_background_compile_switches_between_steps(monkeypatch):
    model, batch, runner = _runner(decode_graph="off")
    gate = threading.Event()
    capture = CompiledBackend.capture

    def held_capture(self, *args, **kwargs):
        assert gate.wait(120), "the test never released the compile"
        return capture(self, *args, **kwargs)
    monkeypatch.setattr(CompiledBackend, "capture", held_capture)
    runner.capture(background=True)
    assert not runner.will_replay(GraphVerdict("prefill", 7))

    _step_matches_eager(model, batch, runner, [(7, 0)], seed=0)          # compile held back: eager
    assert runner.stats()["eager"] == {"compiling": 1} and not runner.stats()["replays"]

    eager = runner._eager

    def finish_compile_mid_step(*args, **kwargs):
        gate.set()
        assert runner.wait_compiled(300)
        assert runner.will_replay(GraphVerdict("prefill", 5))            # ready now ...
        return eager(*args, **kwargs)
    monkeypatch.setattr(runner, "_eager", finish_compile_mid_step)
    _step_matches_eager(model, batch, runner, [(3, 2), (1, 5), (1, 1)], seed=1)
    assert runner.stats()["eager"] == {"compiling": 2} and not runner.stats()["replays"]   # ... yet it stayed eager

    monkeypatch.setattr(runner, "_eager", eager)
    _step_matches_eager(model, batch, runner, [(2, 3), (4, 0)], seed=2)   # the next step replays
    assert runner.stats()["replays"] == {6: 1} and runner.stats()["eager"] == {"compiling": 2}


@pytest.mark.slow
def test_the_few_rows_compile_is_serial():
    from torch._inductor.utils import run_and_get_code
    model, batch, runner = _runner()
    assert runner.stats("decode")["backend"] == "compiled"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)              # Inductor parallelises for the threads it sees (the suite runs 1)
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            _, codes = run_and_get_code(runner.capture)        # prefill first (largest), then decode
    finally:
        torch.set_num_threads(threads)
    assert len(codes) == 2
    prefill, decode = codes
    assert "#pragma omp parallel" in prefill
    assert "#pragma omp parallel" not in decode
    fill_history([batch])
    step = Step([(1, 3), (1, 5)])
    proxy = ProxyTensors({k: torch.randn(step.num_tokens, model.hidden_size) for k in model.proxy_keys})
    verdict = GraphVerdict("decode", step.num_tokens)
    runner.forward(verdict, None, step.positions, step.meta, proxy=proxy)
    assert runner.stats("decode")["replays"] == {2: 1}
