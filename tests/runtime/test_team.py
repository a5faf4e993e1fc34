"""The threads a CPU step uses (runtime/team.py): few-row steps of a model whose linear layers run on
the kernel team (quantized), or whose matrices are small, run torch on one thread, everything else
on the whole team, and torch is told only when the count changes."""
import torch

from stagewise.graph.policy import GraphVerdict
from stagewise.runtime.team import StepTeam, decode_threads


def test_small_matrices_decode_on_one_thread_large_ones_on_all(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    assert decode_threads(model, weights_bytes=2 * 64 * 64 * 4, full=2) == 1
    assert decode_threads(model, weights_bytes=2 * 16 << 20, full=2) == 2      # 16 MiB per matrix
    assert decode_threads(model, weights_bytes=100, full=1) == 1
    assert decode_threads(torch.nn.ReLU(), weights_bytes=100, full=2) == 2     # no linear layer: nothing to judge
    monkeypatch.setenv("STAGEWISE_ADAPT_THREADS", "0")
    assert decode_threads(model, weights_bytes=100, full=2) == 2


def test_the_team_follows_the_verdict_and_changes_torch_only_on_a_change():
    calls = []
    team = StepTeam(full=2, decode=1, set_threads=calls.append)
    steps = [(GraphVerdict("decode", 1), 1), (GraphVerdict("decode", 4), 3), (GraphVerdict("prefill", 64), 40),
             (None, 8), (None, 200), (GraphVerdict("prefill", None), 2)]
    used = []
    for verdict, rows in steps:
        with team.scope(verdict, rows) as threads:
            used.append(threads)
    assert used == [1, 1, 2, 1, 2, 1]        # an eager step (no bucket) of 2 rows: by its rows
    assert calls == [1, 2, 1, 2, 1]


def test_a_quantized_model_runs_few_rows_on_one_torch_thread_while_the_kernel_team_splits(monkeypatch):
    from stagewise.kernels import team as kernel_team
    from stagewise.kernels.quant import T
    from stagewise.model.quantized import QuantLinear, Segment
    big = 64 << 20                                          # 64 MiB per matrix: the older rule keeps all
    layer = QuantLinear(256, [Segment(0, 64, T.Q4_0)], False, torch.float32, exact=True)
    model = torch.nn.Sequential(layer, torch.nn.ReLU())
    monkeypatch.setattr(kernel_team, "size", lambda: 2)
    assert decode_threads(model, weights_bytes=big, full=2) == 1
    monkeypatch.setattr(kernel_team, "size", lambda: 0)     # no team: the kernels split over OpenMP
    assert decode_threads(model, weights_bytes=big, full=2) == 2
    mixed = torch.nn.Sequential(layer, torch.nn.Linear(256, 256))
    monkeypatch.setattr(kernel_team, "size", lambda: 2)
    assert decode_threads(mixed, weights_bytes=big, full=2) == 2
