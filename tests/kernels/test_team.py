"""The kernel team (csrc/team.c): a quantized linear split over it gives the same bits as one thread
(each output is computed by exactly one task), for decode and prefill row counts and every type;
two threads calling at once both get right answers (the second runs on its caller alone); and a
process whose team never started splits over OpenMP as before."""
import ctypes
import threading

import pytest
import torch
from quant_blocks import TYPES, random_blocks

from stagewise.kernels import quant_kernels, team
from stagewise.kernels.quant import QuantizedWeight


def _weight(qtype, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return QuantizedWeight.from_gguf(random_blocks(qtype, n, k, gen), qtype, (n, k)).pack()


def _linear(x, w, exact=False):
    return quant_kernels.run_linear(x, w.data, None, int(w.qtype), w.shape[0], exact, False)


@pytest.fixture(scope="module")
def split():
    """Switch the native library between the team and none (OpenMP at the caller's 1 thread)."""
    if not quant_kernels.available() or team.library() is None:
        pytest.fail("the kernel and team libraries must build here (a C compiler is present)")
    lib = quant_kernels.library()
    assert team.start(3) >= 2
    entry = ctypes.cast(team.library().sw_team_for, ctypes.c_void_p)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def use(on: bool):
        lib.quant_set_team(entry if on else None)
    yield use
    use(True)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 64, 130])
def test_team_gives_the_serial_bits(split, qtype, rows):
    w = _weight(qtype, 1000, 512, rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    split(False)
    alone = _linear(x, w)
    split(True)
    assert torch.equal(_linear(x, w), alone)


def test_two_callers_at_once(split):
    split(True)
    w = _weight(TYPES[0], 2048, 1024)
    xs = [torch.randn(r, 1024, generator=torch.Generator().manual_seed(r)) for r in (1, 3)]
    split(False)
    want = [_linear(x, w) for x in xs]
    split(True)
    bad = []

    def call(i):
        for _ in range(200):
            if not torch.equal(_linear(xs[i], w), want[i]):
                bad.append(i)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_team_size_is_the_first_start(split):
    assert team.start(7) == team.size() >= 2
