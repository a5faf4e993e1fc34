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


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 5, 130])
def test_team_gives_the_serial_bits(split, qtype, rows, exact):
    w = _weight(qtype, 1000, 512, rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    xb = x.bfloat16()
    split(False)
    alone = [_linear(x, w, exact), _linear(xb, w, exact)]
    split(True)
    assert torch.equal(_linear(x, w, exact), alone[0])
    assert torch.equal(_linear(xb, w, exact), alone[1])


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


def test_attention_over_the_team_gives_the_serial_bits(split):
    """Decode against a paged cache (bf16 and fp32) and a bf16 prefill, team on and off."""
    from stagewise.kernels import attention
    lib = attention._load()
    entry = ctypes.cast(team.library().sw_team_for, ctypes.c_void_p)
    lib.attention_set_team.argtypes = [ctypes.c_void_p]
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, 40, 16, 3, 64, generator=gen).to(dtype)     # [2, blocks, bs, Hkv, D]
        q = torch.randn(5, 9, 64, generator=gen).to(dtype)
        tables = torch.randint(1, 40, (5, 8), generator=gen)
        lens = torch.tensor([1, 17, 128, 100, 64])
        runs = []
        for on in (False, True):
            lib.attention_set_team(entry if on else None)
            runs.append(attention.decode_attention(q, cache, tables, lens, 0.125))
        assert torch.equal(runs[0], runs[1])
    if attention.prefill_supports(q, q[:, :3]):
        x = torch.randn(300, 9, 64, generator=gen).bfloat16()
        kv = torch.randn(300, 3, 64, generator=gen).bfloat16()
        runs = []
        for on in (False, True):
            lib.attention_set_team(entry if on else None)
            runs.append(attention.prefill_attention(x, kv, kv, 0.125))
        assert torch.equal(runs[0], runs[1])
    lib.attention_set_team(entry)
