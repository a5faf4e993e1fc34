"""A loaded process freezes its heap (executor/hygiene.py `freeze_heap`): what it holds moves to the
collector's permanent generation, so a full collection later scans only what was made since (with the
~500k objects of a loaded server a full collection stalled /health 240 ms during a burst)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from stagewise.executor.hygiene import freeze_heap
kept = [[i] for i in range(200_000)]            # what a loaded process keeps
before = len(gc.get_objects())
freeze_heap()
after = len(gc.get_objects())
print(gc.get_freeze_count() >= 200_000, after < before // 10)
"""


def test_freeze_heap_moves_what_is_held_out_of_the_collectors_scans():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out
