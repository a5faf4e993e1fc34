"""The engine's stats say which kernels each stage runs (kernels/report.py): the one-stage engine
logs the report at start-up and `stats()["kernels"]` carries it; a PP=2 pipeline's stages send
theirs in their ready messages, so the driver's stats describe both stages."""
from __future__ import annotations

import logging

import pytest

from stagewise import LLM
from stagewise.kernels import build
from stagewise.kernels.report import KernelInfo, describe


def _expected_impl() -> str:
    from stagewise.kernels import gemm
    return "c" if gemm.available() else "torch"


def test_one_stage_logs_and_reports_its_kernels(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="stagewise"):
        with LLM(model=str(llama_dir), prefill_graph="off") as llm:
            kernels = llm.stats()["kernels"]
    entries = [KernelInfo(**k) for k in kernels]
    lines = [r.getMessage() for r in caplog.records if r.name == "stagewise.kernels" and " kernels: " in r.getMessage()]
    assert lines == [f"stage 0 kernels: {describe(entries)}"], lines
    by_family = {k.family: k for k in entries}
    assert {k.stage for k in entries} == {0} and {"gemm_f32", "attention_decode", "team"} <= set(by_family)
    assert by_family["gemm_f32"].impl == _expected_impl()
    if build.mode() == "required":          # CI: every library builds: PyTorch only where we have no kernel
        assert all(k.impl == "c" or k.reason == "no_kernel" for k in entries), entries


@pytest.mark.slow
def test_every_stage_of_a_pipeline_reports_its_kernels(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="stagewise"):
        with LLM(model=str(llama_dir), pp_size=2, prefill_graph="off") as llm:
            kernels = llm.stats()["kernels"]
    stages = {k["stage"] for k in kernels}
    assert stages == {0, 1}, kernels
    # stage processes log warnings only: the driver logs each stage's line as its ready message arrives
    lines = [r.getMessage() for r in caplog.records if " kernels: " in r.getMessage()]
    assert lines == [f"stage {i} kernels: {describe([KernelInfo(**k) for k in kernels if k['stage'] == i])}"
                     for i in (0, 1)], lines
    for stage in stages:
        families = {k["family"]: k for k in kernels if k["stage"] == stage}
        assert families["gemm_f32"]["impl"] == _expected_impl() and "attention_decode" in families, families


@pytest.mark.slow
def test_a_tensor_parallel_stage_reports_its_collectives(llama_dir):
    from stagewise.kernels import comm
    with LLM(model=str(llama_dir), tp_size=2, prefill_graph="off") as llm:
        kernels = llm.stats()["kernels"]
    found = {k["family"]: k for k in kernels}
    assert {k["stage"] for k in kernels} == {0}, kernels
    expected = ("c", "") if comm.available() else ("torch", "gloo")
    assert (found["comm"]["impl"], found["comm"]["op"]) == expected, found["comm"]
