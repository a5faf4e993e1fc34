"""The first hour of a new user: the default answer, honest first-run numbers, early checks with
one-sentence errors (no model loads for the checks; the numbers use the demo model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stagewise.model.loader import EXACT_MAX_HIDDEN, exact_mode


@pytest.mark.parametrize("dtype, hidden, exact", [
    ("auto", 576, True),                    # the default model (SmolLM2-135M): exact, so it answers "Paris"
    ("auto", EXACT_MAX_HIDDEN - 1, True),
    ("auto", EXACT_MAX_HIDDEN, False),      # wider models: the fast mode (8-bit activations)
    ("auto", 4096, False),
    ("float32", 4096, True),                # asked for by name: always exact
    (torch.float32, 4096, True),
    ("bfloat16", 576, False),               # asked for by name: always fast
    ("float16", 576, False),
])
def test_quantized_mode_by_dtype_and_model_width(dtype, hidden, exact):
    assert exact_mode(dtype, SimpleNamespace(hidden_size=hidden)) is exact
