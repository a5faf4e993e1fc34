"""The shared-memory collectives (csrc/comm.c, kernels/comm.py): sums in rank order (the same bits
on every rank, bf16 rounded once), gathers by rank, any size (chunked through the slots), between
threads and between processes; a rank that waits too long stops every rank with one sentence;
bad calls are refused before any memory is touched; the op stays one opaque op under compile."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import uuid

import pytest
import torch

from stagewise.kernels import build, comm, native

pytestmark = pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")
SLOT = 4096          # small slots: every call below spans several chunks


def make_file(size: int, slot: int = SLOT) -> str:
    path = os.path.join(comm.shm_dir(), f"stagewise-test-{uuid.uuid4().hex}")
    comm.create(path, size, slot)
    return path


def open_groups(size: int, slot: int = SLOT, timeout_s: float = 20.0) -> list[comm.ShmGroup]:
    path = make_file(size, slot)
    try:
        return [comm.ShmGroup(path, r, size, timeout_s) for r in range(size)]
    finally:
        os.unlink(path)


def together(groups, fn) -> list:
    out: list = [None] * len(groups)
    errors: list = []

    def run(r):
        try:
            out[r] = fn(groups[r], r)
        except Exception as exc:  # noqa: BLE001  (collected; the test checks them)
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out if not errors else errors


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_sums_in_rank_order(size, dtype):
    groups = open_groups(size)
    gen = torch.Generator().manual_seed(size)
    xs = [torch.randn(37, 129, generator=gen).to(dtype) for _ in range(size)]       # ~9 chunks of 4 KiB
    for _ in range(3):                                                              # buffers get reused
        outs = together(groups, lambda g, r: g.all_reduce(xs[r]))
        acc = xs[0].float()
        for x in xs[1:]:
            acc = acc + x.float()
        for out in outs:
            assert out.dtype == dtype and torch.equal(out, acc.to(dtype))
    assert groups[0].attached() == size


def test_all_gather_orders_columns_by_rank():
    groups = open_groups(2)
    xs = [torch.randn(50, 24) + r for r in range(2)]                                # 96-byte rows, 42 a chunk
    expected = torch.cat(xs, 1)
    for out in together(groups, lambda g, r: g.all_gather(xs[r])):
        assert torch.equal(out, expected)
    outs = together(groups, lambda g, r: g.all_gather(xs[r], dst=1))
    assert torch.equal(outs[1], expected)
    empty = together(groups, lambda g, r: g.all_gather(xs[r][:0]))
    assert [tuple(t.shape) for t in empty] == [(0, 48)] * 2


def _rank_main(path: str, rank: int, conn) -> None:
    torch.set_num_threads(1)
    group = comm.ShmGroup(path, rank, 2, 20.0)
    x = torch.full((1000,), float(rank + 1))
    conn.send((group.all_reduce(x).tolist()[:2], group.all_gather(x.view(10, 100)).shape))


@pytest.mark.slow
def test_between_processes():
    path = make_file(2)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank_main, args=(path, r, pipes[r][1])) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = [pipes[r][0].recv() if pipes[r][0].poll(120) else None for r in range(2)]
    finally:
        os.unlink(path)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert results == [([3.0, 3.0], torch.Size([10, 200]))] * 2


def test_a_rank_that_waits_too_long_stops_every_rank():
    groups = open_groups(2, timeout_s=0.3)
    with pytest.raises(RuntimeError, match="rank 0 of 2 waited longer than its timeout"):
        groups[0].all_reduce(torch.ones(4))
    with pytest.raises(RuntimeError, match="another rank of its stage gave up"):
        groups[1].all_reduce(torch.ones(4))


def test_abort_ends_the_peers_wait():
    groups = open_groups(2)
    groups[1].abort()
    with pytest.raises(RuntimeError, match="gave up"):
        groups[0].all_gather(torch.ones(2, 2))


@pytest.mark.parametrize("op,args,problem", [
    ("all_reduce", lambda g: (torch.ones(3, dtype=torch.float64), g.handle), "CPU float32 or bfloat16"),
    ("all_reduce", lambda g: (torch.ones(3, dtype=torch.int32), g.handle), "CPU float32 or bfloat16"),
    ("all_reduce", lambda g: (torch.ones(2), 63), "not open in this process"),
    ("all_gather", lambda g: (torch.ones(3), g.handle, 2, -1), r"\[rows, columns\]"),
    ("all_gather", lambda g: (torch.ones(2, 2), g.handle, 2, 2), "destination 2"),
    ("all_gather", lambda g: (torch.ones(2, 2), g.handle, 3, -1), "has 2 ranks"),
    ("all_gather", lambda g: (torch.ones(1, SLOT), g.handle, 2, -1), "refused its arguments")])
def test_bad_calls_are_refused(op, args, problem):
    """By the op (the C++ registration where it built) and by the Python registration alike."""
    group = open_groups(2)[0]
    for fn in (getattr(torch.ops.stagewise, op), getattr(comm, f"_{op}")):
        with pytest.raises(ValueError, match=problem):
            fn(*args(group))


def test_the_cpp_op_is_registered():
    if build.cxx_compiler() is None and build.mode() == "auto":
        pytest.skip("no C++ compiler: the Python registration serves")
    assert comm.available() and native.loaded("comm")


@pytest.mark.slow
def test_one_opaque_op_under_compile():
    group = open_groups(1)[0]
    weight = torch.randn(8, 8)

    def body(x):
        return group.all_reduce(torch.relu(x @ weight)) * 2
    x = torch.randn(5, 8)
    explained = torch._dynamo.explain(body)(x)
    assert explained.graph_break_count == 0
    assert "stagewise.all_reduce" in str(explained.graphs[0].graph)
    torch.testing.assert_close(torch.compile(body, backend="aot_eager")(x), torch.relu(x @ weight) * 2)
