"""The gate between a background compile and the steps (graph/background.py): the compile's Python
waits while a step runs and in the short gap after one, runs while the engine is idle, and an engine
kept busy long enough waits once for the compile to finish. A counting loop stands in for the compile."""
import threading
import time

from stagewise.graph.background import CompileGate


class Work:
    """A compile stand-in: Python calls in a loop (the gate checks at each call), `total` of them."""

    def __init__(self, gate: CompileGate, total: int = 10**9):
        self.gate, self.total, self.done = gate, total, 0
        self.thread = gate.thread = threading.Thread(target=self._run, daemon=True)

    def _tick(self) -> None:
        self.done += 1

    def _run(self) -> None:
        self.gate.enter()
        while self.done < self.total:
            self._tick()

    def stop(self) -> None:
        """End the loop and the thread (left running, it would slow every later test in the session)."""
        self.total = 0
        self.thread.join(30)
        assert not self.thread.is_alive()


def _until(cond, timeout_s=30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_the_compile_waits_for_steps_and_their_gap_and_runs_when_idle():
    gate = CompileGate()
    gate.GRACE_S, gate.FOREGROUND_AFTER_S = 0.5, 1e9
    work = Work(gate)
    work.thread.start()
    try:
        assert _until(lambda: work.done > 1000)          # idle engine: the compile runs
        with gate.step():
            time.sleep(0.01)                              # the compile reaches its next call and waits
            held = work.done
            time.sleep(0.2)
            assert work.done - held <= 1                  # nothing during the step
        after = work.done
        time.sleep(0.05)
        assert work.done - after <= 1                     # nor in the gap before a next step
        assert _until(lambda: work.done > after + 1000)   # then it runs again
        assert gate.held_s > 0.2
    finally:
        work.stop()


def test_a_busy_engine_waits_once_for_the_compile_to_finish():
    gate = CompileGate()
    gate.GRACE_S, gate.FOREGROUND_AFTER_S = 0.5, 0.3
    work = Work(gate, total=200_000)
    with gate.step():                                     # busy before the compile starts
        work.thread.start()
        time.sleep(0.05)
    steps = 0
    while work.thread.is_alive() and steps < 200:         # steps back to back
        with gate.step():
            if steps == 0:
                assert work.done <= 1                     # held while the stretch is short
            time.sleep(0.01)
        steps += 1
    assert not work.thread.is_alive() and work.done == work.total
    assert 0.3 / 0.01 * 0.5 <= steps < 200                # it finished after the stretch, in one wait
