"""/metrics says which kernels each stage runs: `stagewise_kernel_info`, one series of value 1 per
stage and kernel family, labelled with our C kernel's instruction-set path or PyTorch's op and why."""
from __future__ import annotations

import re

from stagewise.kernels import build
from stagewise.kernels.report import KernelInfo, as_dicts
from stagewise.server.metrics import ServerMetrics

try:
    import httpx2 as httpx
except ImportError:
    import httpx

_SERIES = re.compile(r'stagewise_kernel_info\{(.*)\} (\S+)')


def _series(text: str) -> list[dict[str, str]]:
    found = []
    for line in text.splitlines():
        m = _SERIES.fullmatch(line)
        if m:
            assert float(m.group(2)) == 1.0, line
            found.append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
    return found


def test_the_gauge_has_one_series_per_stage_and_family():
    kernels = as_dicts([KernelInfo("gemm_q4_k", "c", "avx512_vnni"),
                        KernelInfo("gemm_f32", "torch", op="mkldnn", reason="off", note="STAGEWISE_KERNELS=off",
                                   stage=1)])
    text = ServerMetrics(lambda: {"kernels": kernels}, "m").render().decode()
    assert "# TYPE stagewise_kernel_info gauge" in text
    assert _series(text) == [
        {"model_name": "m", "stage": "0", "family": "gemm_q4_k", "impl": "c", "isa": "avx512_vnni", "op": "",
         "reason": ""},
        {"model_name": "m", "stage": "1", "family": "gemm_f32", "impl": "torch", "isa": "", "op": "mkldnn",
         "reason": "off"}]
    assert _series(ServerMetrics(lambda: {}, "m").render().decode()) == []      # no report yet: no series


def test_the_server_exports_its_stage_s_kernels(server):
    series = _series(httpx.get(server.url + "/metrics", timeout=10.0).text)
    families = {s["family"]: s for s in series}
    assert {s["stage"] for s in series} == {"0"}, series
    assert {"gemm_f32", "attention_decode", "attention_prefill", "team"} <= set(families), series
    for s in series:
        assert (s["impl"] == "c") == (s["reason"] == ""), s            # PyTorch's op always says why
        assert s["impl"] == "torch" or s["op"] or s["isa"] or s["family"] in ("team", "comm", "decode"), s
    mode = build.mode()
    if mode == "required":          # CI: every library built, so PyTorch runs only where we have no kernel
        assert all(s["impl"] == "c" or s["reason"] == "no_kernel" for s in series), series
        assert families["gemm_f32"]["impl"] == "c" and families["gemm_f32"]["isa"], series
    elif mode == "off":
        assert {(s["impl"], s["reason"]) for s in series} == {("torch", "off")}, series
