"""The memory plan against what a process measures: the plan's predicted peak of the default model's
one-process run (the driver's process and its libraries, weights as held, activations, the KV it wrote) is
within 10% (or 100 MiB) of the peak RSS the kernel reports for `stagewise generate`."""
import os
import subprocess
import sys

import pytest

from stagewise.checkpoint.facts import read_facts
from stagewise.checkpoint.files import load_tokenizer
from stagewise.config import EngineConfig
from stagewise.model.source import ensure_default_model
from stagewise.planning import memory
from stagewise.planning.report import _plans, _weights_of

MIB = 1 << 20


@pytest.mark.slow
def test_the_plan_predicts_the_default_models_peak_within_a_tenth():
    model = ensure_default_model()
    load_tokenizer(model)      # converted and cached here: the converter child (transformers) is not measured
    config = EngineConfig.from_kwargs(model=str(model))
    facts = read_facts(model)
    plan = _plans(config, facts, _weights_of(config, facts), (facts.num_layers,), 1, 64 << 30, refuse=False)[0]
    running = memory.SHARED_LIBRARY_BYTES + memory.DRIVER_RUNTIME_BYTES     # the one process, before weights
    predicted = plan.peak_bytes(kv_tokens=64, block_size=config.cache.block_size, running=running)
    measure = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss << 10)")   # kB on Linux -> bytes
    done = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "stagewise", "--log-level", "ERROR",
                           "generate", "--model", str(model), "--prompt", "Hello", "--max-tokens", "8"],
                          check=True, capture_output=True, text=True, env={**os.environ, "STAGEWISE_MALLOC": "system"})
    measured = int(done.stdout)
    assert abs(predicted - measured) <= max(measured // 10, 100 * MIB), \
        f"predicted {predicted / MIB:.0f} MiB, measured {measured / MIB:.0f} MiB"
