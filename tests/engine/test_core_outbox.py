"""The engine core never waits for its client: while the client reads nothing, the core keeps
stepping and its messages queue (far more than a pipe holds); once the client reads, every one
arrives, in order; and the client's threads run nicer than the core. A scripted engine, no model."""
import multiprocessing as mp
import os
import threading
import time

from stagewise.engine.core import EngineCore
from stagewise.engine.messages import EngineOutputs, StopEngine, recv, send
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
        msg = recv(from_core)
        assert isinstance(msg, EngineOutputs)
        texts += [d.text_tail for d in msg.deltas]
        if any(d.finished for d in msg.deltas):
            break
    assert texts == [CHUNK] * 12                  # every step's delta, in order
    core.join(30)
    assert codes == [0] and engine.shut_down


def test_the_client_side_yields_the_cpu_to_the_engine_core():
    """The client's thread (and threads it starts later) run nicer than a core spawned before."""
    import subprocess
    import sys
    code = ("import os, subprocess, sys, threading\n"
            "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "from stagewise.engine.core_runner import yield_cpu_to_core\n"
            "base = os.getpriority(os.PRIO_PROCESS, 0)\n"
            "yield_cpu_to_core(); yield_cpu_to_core()\n"
            "later = []\n"
            "t = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
            "t.start(); t.join()\n"
            "print(os.getpriority(os.PRIO_PROCESS, 0) - base, later[0] - base, "
            "os.getpriority(os.PRIO_PROCESS, core.pid) - base)\n"
            "core.kill()\n")
    env = {k: v for k, v in os.environ.items() if k != "STAGEWISE_HTTP_NICE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "5", "0"]      # once (not twice), inherited, the core untouched
