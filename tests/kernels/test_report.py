"""Which kernels run (kernels/report.py): a family whose library built reports our C kernel with the
instruction-set path the library was built for; STAGEWISE_KERNELS=off reports PyTorch's op with
the reason; a stage logs the report as one INFO line; the report crosses the ready message; the
engine's stats carry it for every stage."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from stagewise.kernels import build, report
from stagewise.kernels.report import KernelInfo

ISAS = {"avx512_vnni", "avx512", "avx_vnni", "avx2_vnni", "avx2", "portable", "avx512_bf16"}


def _load(model_dir, quantization=None, dtype="float32"):
    from stagewise.checkpoint.facts import read_facts
    from stagewise.model.loader import load_model
    from stagewise.parallel.partition import StageInfo
    stage = StageInfo.single(read_facts(model_dir).num_layers)
    return load_model(model_dir, stage, dtype, quantization=quantization)


def _by_family(entries: list[KernelInfo]) -> dict[str, KernelInfo]:
    families = [k.family for k in entries]
    assert len(families) == len(set(families)), families       # one entry per family
    return {k.family: k for k in entries}


@pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")
def test_a_quantized_model_reports_the_c_kernels_that_built(llama_dir):
    from stagewise.kernels import attention, quant_kernels
    if not (quant_kernels.available() and attention.available()):
        assert build.mode() != "required"
        pytest.skip("the kernels did not build here (STAGEWISE_KERNELS=auto)")
    found = _by_family(report.kernel_report(_load(llama_dir, "int4"), "cpu", stage=3))
    # --quantization int4: linear layers Q4_1, the embedding and LM head Q8_0; no float GEMM
    assert {"gemm_q4_1", "gemm_q8_0", "attention_decode", "attention_prefill", "team"} <= set(found)
    assert not {"gemm_f32", "gemm_bf16", "comm"} & set(found)
    lib = quant_kernels.library()
    built, path = build.isa_of(lib), lib.quant_isa().decode()
    for family in ("gemm_q4_1", "gemm_q8_0"):
        k = found[family]
        assert (k.impl, k.reason, k.stage) == ("c", "", 3), k
        assert k.isa.startswith(path) and k.isa in ISAS, k
        assert k.isa.endswith("_vnni") == bool({"avx512_vnni", "avx_vnni"} & built), (k, built)
    assert found["attention_decode"].impl == "c" and found["attention_decode"].isa in ISAS
    if "avx512_vnni" in build.cpu_flags() and path == "avx512":     # this CPU, a native build: the VNNI path
        assert found["gemm_q4_1"].isa == "avx512_vnni"
    line = report.describe(list(found.values()))
    assert f"q4_1 gemm C/{found['gemm_q4_1'].isa}" in line and "attention decode C/" in line, line
    # the tiny Llama's 4 quantized blocks: its eager decode steps run them in one call
    assert found["decode"].impl == "c" and found["decode"].note == "eager decode steps: 4 layers in one call"


@pytest.mark.skipif(build.mode() == "off", reason="STAGEWISE_KERNELS=off")
def test_a_float_model_reports_its_gemm_by_dtype(llama_dir):
    from stagewise.kernels import gemm
    if not gemm.available():
        assert build.mode() != "required"
        pytest.skip("the GEMM kernels did not build here (STAGEWISE_KERNELS=auto)")
    found = _by_family(report.kernel_report(_load(llama_dir), "cpu"))
    k = found["gemm_f32"]
    assert k.impl == "c" and k.isa in ISAS and not any(f.startswith("gemm_q") for f in found), found
    assert ("packed" in k.note) == (gemm.layout(__import__("torch").float32) is not None), k
    from stagewise.kernels import rope
    if rope.available():          # a Llama: its fused q/k heads roped (and the KV cache written) by the op
        assert found["rope"].impl == "c" and found["rope"].isa in ISAS and "eager steps" in found["rope"].note
    on_gpu = _by_family(report.kernel_report(_load(llama_dir), "cuda"))     # where the layers run decides
    assert {(k.impl, k.reason) for k in on_gpu.values()} == {("torch", "device")}, on_gpu


_OFF = """
import json, sys
sys.path[:0] = [{tests!r}]
from test_report import _load
from stagewise.kernels import report
print(json.dumps(report.as_dicts(report.kernel_report(_load({model!r}, {quant!r}), "cpu"))))
"""


@pytest.mark.parametrize("quant", [None, "int8"])
def test_kernels_off_reports_pytorch_and_why(llama_dir, tmp_path, quant):
    """STAGEWISE_KERNELS=off (in a fresh process: the switch is read when libraries load)."""
    env = {**os.environ, "STAGEWISE_KERNELS": "off", "STAGEWISE_CACHE": str(tmp_path)}
    code = _OFF.format(tests=os.path.dirname(__file__), model=str(llama_dir), quant=quant)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found = _by_family([KernelInfo(**k) for k in json.loads(out.stdout.strip().splitlines()[-1])])
    assert {(k.impl, k.reason, k.isa) for k in found.values()} == {("torch", "off", "")}, found
    gemm = "gemm_q8_0" if quant else "gemm_f32"
    assert found[gemm].op == ("dequantize+linear" if quant else "mkldnn")
    assert found["attention_decode"].op == found["attention_prefill"].op == "sdpa"
    assert "attention decode PyTorch sdpa (STAGEWISE_KERNELS=off)" in report.describe(list(found.values()))


def test_a_library_that_did_not_build_is_reported_with_the_compiler_s_reason(monkeypatch):
    """`auto` with a broken library: PyTorch's op, reason not_built, and the build's own words."""
    monkeypatch.setenv("STAGEWISE_KERNELS", "auto")
    monkeypatch.setitem(build.failures, "quant", "cc failed building quant_x.so with exit status 1")
    monkeypatch.setattr(report, "_loaded", lambda load: None)
    k = report._quant("q4_k")
    assert (k.family, k.impl, k.reason, k.op) == ("gemm_q4_k", "torch", "not_built", "dequantize+linear")
    assert k.describe() == "q4_k gemm PyTorch dequantize+linear (not built: cc failed building quant_x.so with " \
                           "exit status 1)"


def test_announce_logs_one_info_line(llama_dir, caplog):
    model = _load(llama_dir)
    with caplog.at_level(logging.INFO, logger="stagewise.kernels"):
        entries = report.announce(model, "cpu", stage=1)
    lines = [r.getMessage() for r in caplog.records if "kernels:" in r.getMessage()]
    assert lines == [f"stage 1 kernels: {report.describe(entries)}"]
    assert "f32 gemm " in lines[0] and "attention decode " in lines[0]


def test_the_report_crosses_the_ready_message():
    from stagewise.executor.messages import CODEC, CONTROL, ReadyMsg
    kernels = [KernelInfo("gemm_q4_k", "c", "avx512_vnni"), KernelInfo("comm", "torch", op="gloo", reason="not_built",
                                                                        note="not built: no C compiler")]
    msg = ReadyMsg(None, 1.5, kernels=kernels)
    header, tensors = CODEC.encode(msg)
    back = CODEC.decode(header, tensors, CONTROL)
    assert isinstance(back, ReadyMsg) and back.kernels == kernels
    old = CODEC.decode(*CODEC.encode(ReadyMsg(error="stage 0: boom")), CONTROL)    # no report: an empty one
    assert old.kernels == [] and old.error == "stage 0: boom"


def test_summary_names_every_stage():
    one = report.as_dicts([KernelInfo("gemm_f32", "c", "avx2", op="mkldnn", note="unpacked up to 32 rows")])
    assert report.summary(one) == "kernels: f32 gemm C/avx2 (unpacked up to 32 rows, mkldnn beyond)"
    two = one + report.as_dicts([KernelInfo("gemm_f32", "torch", op="mkldnn", reason="off",
                                            note="STAGEWISE_KERNELS=off", stage=1)])
    assert report.summary(two) == ("kernels: stage 0: f32 gemm C/avx2 (unpacked up to 32 rows, mkldnn beyond); "
                                   "stage 1: f32 gemm PyTorch mkldnn (STAGEWISE_KERNELS=off)")
    assert report.summary([]) == "kernels: none"


def test_without_a_model_every_family_is_reported():
    from stagewise.kernels.quant_formats import SUPPORTED
    found = _by_family(report.kernel_report())
    assert {f"gemm_{t.name.lower()}" for t in SUPPORTED} | {"gemm_f32", "gemm_bf16", "attention_decode",
                                                             "attention_prefill", "norm", "rope", "comm",
                                                             "team"} == set(found)
    if build.mode() == "required":
        assert all(k.impl == "c" or k.reason == "no_kernel" for k in found.values()), found
