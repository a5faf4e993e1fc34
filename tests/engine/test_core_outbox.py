"""The engine core never waits for its client: while the client reads nothing, the core keeps
stepping and its messages queue (far more than a pipe holds); once the client reads, every one
arrives, in order; and the client's threads run nicer than the core. A scripted engine, no model."""
import multiprocessing as mp
import os
import threading
import time

from stagewise.core.core import EngineCore
from stagewise.core.wire import EngineOutputs, StopEngine, recv_core, send
from stagewise.engine.outputs import StepOutputs
from stagewise.request import CompletionOutput, RequestOutput

CHUNK = "x" * 65536          # one step's new text: a whole pipe buffer on Linux


class ChattyEngine:
    """One request whose text grows by CHUNK every step, for `num_steps` steps."""

    recovering = None

    def __init__(self, num_steps: int):
        self.num_steps, self.steps, self.shut_down = num_steps, 0, False

    def has_unfinished(self) -> bool:
        return self.steps < self.num_steps

    def step(self) -> StepOutputs:
        self.steps += 1
        done = self.steps == self.num_steps
        out = RequestOutput("r", None, [1], [CompletionOutput(0, CHUNK * self.steps, list(range(self.steps)),
                                                              "length" if done else None, None, None)],
                            finished=done)
        return StepOutputs([out], progressed=True)

    def abort(self, request_id) -> None:
        pass

    def fault(self) -> None:
        return None

    def stats(self) -> dict:
        return {"steps": self.steps}

    def shutdown(self) -> None:
        self.shut_down = True


def test_a_client_that_does_not_read_holds_up_no_step():
    core_in, to_core = mp.Pipe(duplex=False)
    from_core, core_out = mp.Pipe(duplex=False)
    engine = ChattyEngine(num_steps=12)
    codes: list[int] = []
    core = threading.Thread(target=lambda: codes.append(EngineCore(engine, core_in, core_out).run()), daemon=True)
    core.start()
    deadline = time.monotonic() + 60
    while engine.steps < engine.num_steps and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.steps == engine.num_steps       # 12 steps, 768 KiB of output, nothing read yet
    send(to_core, StopEngine())
    texts = []
    while True:
        msg = recv_core(from_core)
        assert isinstance(msg, EngineOutputs)
        texts += [d.text_tail for d in msg.deltas]
        if any(d.finished for d in msg.deltas):
            break
    assert texts == [CHUNK] * 12                  # every step's delta, in order
    core.join(30)
    assert codes == [0] and engine.shut_down


# a client process: it starts a spawned core (as `stagewise serve` does), then reports its own
# priority, a later thread's and the core's, relative to where it began
NICE_PROBE = """
import os, sys, threading
sys.path.insert(0, {tests!r})
from test_core_outbox import ChattyEngine
from stagewise.core.core_runner import kill_core, start_core, yield_cpu_to_core
base = os.getpriority(os.PRIO_PROCESS, 0)
pipes = start_core(12, ChattyEngine)
yield_cpu_to_core()
later = []
t = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0)))
t.start(); t.join()
core = os.getpriority(os.PRIO_PROCESS, pipes.runner.pid)
print(os.getpriority(os.PRIO_PROCESS, 0) - base, later[0] - base, core - base)
kill_core(pipes)
"""


def _nice_probe(nice: str | None) -> list[str]:
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "STAGEWISE_HTTP_NICE"}
    if nice is not None:
        env["STAGEWISE_HTTP_NICE"] = nice
    code = NICE_PROBE.format(tests=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_client_side_yields_the_cpu_to_the_engine_core():
    """Starting a core lowers the client's priority (threads it starts later inherit it), once;
    the core, spawned before, keeps its own. STAGEWISE_HTTP_NICE sets how much, 0 turns it off."""
    assert _nice_probe(None) == ["5", "5", "0"]
    assert _nice_probe("0") == ["0", "0", "0"]
