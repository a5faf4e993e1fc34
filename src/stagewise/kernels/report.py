"""Which kernels run: for each kernel family a model uses, our C kernel (and the instruction-set path
it was built with and dispatches to) or PyTorch's op, and why PyTorch's.

`kernel_report(model, device)` asks the loaded libraries (`build`, `native`, the concern modules)
and the model's layers what this process runs; without a model, every family as this process would
run it. Each stage computes its report once its weights are loaded, logs it as one INFO line
(`announce`) and sends it to the driver in its ready message; the engine's `stats()["kernels"]`,
`/metrics`' `stagewise_kernel_info` and `stagewise generate`'s summary show it (docs/kernels.md).

Families: `gemm_<type>` (a GGUF/quantized type: `gemm_q4_k`, `gemm_q8_0`, ...; lookups of a
quantized embedding included), `gemm_f32` / `gemm_bf16` / `gemm_f16` (float linear layers),
`attention_decode`, `attention_prefill`, `norm` (RMSNorm, eager steps; compiled graphs run PyTorch's
ops), `rope` (rope of the fused q/k heads and the KV cache write, eager steps), `decode` (a stage
whose eager decode steps run all its layers in one call of `stagewise::decode_layers`; reported
only where it does), `comm` (tensor-parallel collectives, with --tp-size only) and `team` (the
kernel threads).
Reasons for PyTorch: `off` (STAGEWISE_KERNELS=off), `not_built` (the library did not build: no
compiler, a compiler error), `no_kernel` (none for this dtype, format or shape), `device` (the model
is not on the CPU).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import build

if TYPE_CHECKING:
    import torch

# NOTE: torch and the concern modules are imported where a report is made: the driver imports this
# module with executor/messages.py (ReadyMsg carries `KernelInfo`), and needs neither

log = logging.getLogger("stagewise.kernels")

C, TORCH = "c", "torch"


@dataclass(frozen=True)
class KernelInfo:
    """One kernel family of one stage. `impl`: "c" (ours) or "torch". `isa`: the C kernel's
    instruction-set path (avx512_vnni, avx512_bf16, avx512, avx2_vnni, avx2, portable; "" where the
    kernel has no ISA-specific code). `op`: PyTorch's op that runs instead (mkldnn, sdpa, gloo, ...),
    or, for C, what runs beside it (e.g. mkldnn above the small-row kernel's rows). `reason`: why
    PyTorch's op runs (off, not_built, no_kernel, device; "" for C). `note`: the detail for people."""

    family: str
    impl: str
    isa: str = ""
    op: str = ""
    reason: str = ""
    note: str = ""
    stage: int = 0

    def describe(self) -> str:
        """`q4_k gemm C/avx512_vnni`, `attention prefill PyTorch sdpa (no kernel for f16, head size 64)`."""
        kind, _, rest = self.family.partition("_")
        name = f"{rest} {kind}" if kind == "gemm" else f"{kind} {rest}".strip()
        if self.impl == C:
            text = f"{name} C/{self.isa}" if self.isa else f"{name} C"
            extra = ", ".join(x for x in (self.note, f"{self.op} beyond" if self.op else "") if x)
        else:
            text = f"{name} PyTorch {self.op}".rstrip()
            extra = self.note or self.reason
        return f"{text} ({extra})" if extra else text


def describe(report: list[KernelInfo]) -> str:
    """The report as one line: `q4_k gemm C/avx512_vnni, f32 gemm C/avx512 (packed), ...`."""
    return ", ".join(k.describe() for k in report) or "none"


def announce(model: Any, device: torch.device | str = "cpu", stage: int = 0) -> list[KernelInfo]:
    """`kernel_report` of a stage that just loaded its weights, logged as one INFO line."""
    report = kernel_report(model, device, stage)
    log.info("stage %d kernels: %s", stage, describe(report))
    return report


def kernel_report(model: Any = None, device: torch.device | str = "cpu", stage: int = 0) -> list[KernelInfo]:
    """What runs in this process for each kernel family `model` uses (None: every family, as this
    process would run it), tagged with `stage`."""
    import torch

    from . import gemm, quant_kernels
    device = torch.device(device)
    if model is not None:
        used = _used(model)
    else:
        used = _Used(quant={str(t.name).lower() for t in quant_kernels.SUPPORTED},
                     floats={d: [gemm.layout(d) is not None] for d in (torch.float32, torch.bfloat16)},
                     attention=(torch.float32, 64), tp_group=None, norms={torch.float32, torch.bfloat16},
                     ropes={torch.float32, torch.bfloat16})
    if device.type != "cpu":          # the kernels are CPU kernels (a GGUF file is dequantized there)
        ops = [(f"gemm_{_dtype_name(d)}", "linear") for d in used.floats]
        ops += [(f"gemm_{q}", "dequantize+linear") for q in sorted(used.quant)]
        if used.attention is not None:
            ops += [("attention_decode", "sdpa"), ("attention_prefill", "sdpa")]
        if used.norms:
            ops.append(("norm", "rms_norm"))
        if used.ropes or used.normed_ropes:
            ops.append(("rope", "rope+index_copy"))
        return [KernelInfo(family, TORCH, op=op, reason="device", note=f"on {device.type}", stage=stage)
                for family, op in ops]
    out = [_quant(q) for q in sorted(used.quant)]
    out += [_float_gemm(d, packed) for d, packed in used.floats.items()]
    if used.attention is not None:
        out += _attention(*used.attention)
    if used.norms:
        out.append(_norm(used.norms))
    if used.ropes or used.normed_ropes:
        out.append(_rope(used.ropes, used.normed_ropes))
    if used.tp_group is not None or model is None:
        out.append(_comm(used.tp_group, model is None))
    plan = getattr(model, "_plan_decode_layers", None)
    layers = plan() if plan is not None else None
    if layers is not None:
        out.append(KernelInfo("decode", C, note=f"eager decode steps: {len(layers['norms']) // 2} layers in one call"))
    out.append(_team())
    return [replace(k, stage=stage) for k in out]


@dataclass
class _Used:
    quant: set[str]                                  # GGUF type names, lower case
    floats: dict[torch.dtype, list[bool | None]]     # dtype -> each float layer: packed? (None: nn.Linear's op)
    attention: tuple[torch.dtype, int] | None        # (KV dtype, head size)
    tp_group: Any
    norms: set[torch.dtype] = field(default_factory=set)    # RMSNorm weights' dtypes
    ropes: set[torch.dtype] = field(default_factory=set)    # activation dtypes of fused-qkv attention layers
    normed_ropes: set[torch.dtype] = field(default_factory=set)    # the same with q/k norms (Qwen3: PyTorch's rope)


def _used(model: Any) -> _Used:
    """The families `model`'s layers run (duck-typed: kernels/ imports nothing of model/)."""
    import torch
    quant: set[str] = set()
    floats: dict[torch.dtype, list[bool | None]] = {}
    norms: set[torch.dtype] = set()
    ropes: dict[bool, set[torch.dtype]] = {False: set(), True: set()}
    act = getattr(model, "dtype", None)
    act = act if isinstance(act, torch.dtype) and act.is_floating_point else torch.float32
    for m in model.modules():
        if type(m).__name__ == "RMSNorm" and isinstance(getattr(m, "weight", None), torch.Tensor):
            norms.add(m.weight.dtype)
        if type(m).__name__ == "LlamaAttention" and hasattr(m, "qkv_proj"):     # ropes q/k of a fused qkv
            ropes[getattr(m, "q_norm", None) is not None].add(act)
        segments = getattr(m, "segments", None)
        if isinstance(segments, tuple) and hasattr(m, "in_features"):       # QuantLinear
            for i, seg in enumerate(segments):
                if seg.qtype is None:             # float rows of a mixed layer: the unpacked float kernel
                    floats.setdefault(getattr(m, f"segment{i}").dtype, []).append(False)
                else:
                    quant.add(seg.qtype.name.lower())
        elif type(m).__name__ == "QuantEmbedding":
            quant.add(m.qtype.name.lower())
        elif getattr(m, "held_qtype", None) is not None:      # layers holding blocks themselves (gpt-oss's experts)
            quant.add(m.held_qtype.name.lower())
        elif isinstance(m, torch.nn.Linear):          # model/cpu_gemm.Linear has `pack_`; a plain one runs F.linear
            floats.setdefault(m.weight.dtype, []).append(bool(m.packed) if hasattr(m, "pack_") else None)
        elif isinstance(m, torch.nn.Embedding) and getattr(m, "serves_head", False):
            floats.setdefault(m.weight.dtype, []).append(bool(getattr(m, "packed", False)))
    attention_of = None
    spec = getattr(model, "kv_cache_spec", None)
    if callable(spec):
        try:
            _, head_dim = spec()
            dtype = next(model.parameters()).dtype
            attention_of = (dtype if dtype.is_floating_point else torch.float32, int(head_dim))
        except (StopIteration, TypeError, ValueError):
            attention_of = None
    clock = model.__dict__.get("tp_clock")
    return _Used(quant, floats, attention_of, getattr(clock, "group", None), norms, ropes[False], ropes[True])


def _dtype_name(dtype: torch.dtype) -> str:
    import torch
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, str(dtype).split(".")[-1])


def _why_missing(name: str) -> tuple[str, str]:
    """(reason, note) for a library `name` that is not loaded."""
    if build.mode() == "off":
        return "off", "STAGEWISE_KERNELS=off"
    why = build.failures.get(name)
    return "not_built", f"not built: {why}" if why else "not built"


def _vector_isa(isa: frozenset[str]) -> str:
    """The path of the kernels with 16-lane AVX-512 code (packed GEMM): avx512, avx2 or portable."""
    return "avx512" if "avx512f" in isa else _lane8_isa(isa)


def _lane8_isa(isa: frozenset[str]) -> str:
    """The path of the 8-lane kernels (csrc/vec.h: small-row GEMM, decode attention for D % 16)."""
    return "avx2" if {"avx2", "fma"} <= isa else "portable"


def _ops_note(name: str) -> str:
    """Empty where the ops' C++ registration loaded; else how the ops reach the kernels."""
    from . import native
    return "" if native.loaded(name) else "ops via ctypes"


def _loaded(load) -> Any:
    """A concern's library (its `_load`), None where kernels are off or it did not build; a
    `KernelError` under `required` means the same here (the stage would not have started)."""
    if build.mode() == "off":
        return None
    try:
        return load()
    except build.KernelError:
        return None


def _quant(qname: str) -> KernelInfo:
    from . import quant_kernels
    family = f"gemm_{qname}"
    lib = _loaded(lambda: quant_kernels._load("native"))
    if lib is None:
        reason, note = _why_missing("quant")
        return KernelInfo(family, TORCH, op="dequantize+linear", reason=reason, note=note)
    if qname.upper() not in {t.name for t in quant_kernels.SUPPORTED}:
        return KernelInfo(family, TORCH, op="dequantize+linear", reason="no_kernel", note=f"no kernel for {qname}")
    path = lib.quant_isa().decode()              # avx512, avx2 or portable (csrc/quant_simd.h)
    built = build.isa_of(lib)
    if path != "portable" and {"avx512": "avx512_vnni", "avx2": "avx_vnni"}[path] in built:
        path += "_vnni"
    return KernelInfo(family, C, isa=path, note=_ops_note("quant"))


def _float_gemm(dtype: torch.dtype, layers: list[bool | None]) -> KernelInfo:
    import torch

    from . import gemm
    family = f"gemm_{_dtype_name(dtype)}"
    if dtype not in (torch.float32, torch.bfloat16):
        return KernelInfo(family, TORCH, op="linear", reason="no_kernel", note=f"no kernel for {_dtype_name(dtype)}")
    if layers and all(p is None for p in layers):
        return KernelInfo(family, TORCH, op="linear", reason="no_kernel", note="plain nn.Linear layers")
    lib = _loaded(gemm._load)
    if lib is None:
        reason, note = _why_missing("gemm")
        return KernelInfo(family, TORCH, op="mkldnn", reason=reason, note=note)
    built = build.isa_of(lib)
    packed = any(p for p in layers)
    unpacked = any(p is False for p in layers) or not layers
    if dtype == torch.bfloat16 and gemm.NATIVE_BF16 and "avx512_bf16" in built:
        isa = "avx512_bf16"
    else:
        isa = _vector_isa(built) if packed else _lane8_isa(built)
    notes = ["packed"] if packed else []
    rows = gemm._rows_limit(lib, dtype) if unpacked else 0
    if unpacked and rows == 0 and not any(p for p in layers):
        return KernelInfo(family, TORCH, op="mkldnn", reason="no_kernel",
                          note=f"this build has no small-row {_dtype_name(dtype)} kernel")
    if unpacked and rows:
        notes.append(f"unpacked up to {rows} rows")
    if _ops_note("gemm"):
        notes.append(_ops_note("gemm"))
    return KernelInfo(family, C, isa=isa, op="mkldnn" if unpacked else "", note=", ".join(notes))


def _attention(dtype: torch.dtype, head_dim: int) -> list[KernelInfo]:
    import torch

    from . import attention
    lib = _loaded(attention._load)
    if lib is None:
        reason, note = _why_missing("attention")
        return [KernelInfo("attention_decode", TORCH, op="sdpa", reason=reason, note=note),
                KernelInfo("attention_prefill", TORCH, op="sdpa", reason=reason, note=note)]
    hkv = 1
    q = torch.empty(1, hkv, head_dim, dtype=dtype)
    cache = torch.empty(2, 1, 1, hkv, head_dim, dtype=dtype)
    built = build.isa_of(lib)
    what = f"{_dtype_name(dtype)}, head size {head_dim}"
    if attention.supports(q, cache):
        wide = head_dim % 16 == 0 and hasattr(lib, f"decode_attention16_{'f32' if dtype == torch.float32 else 'bf16'}")
        decode = KernelInfo("attention_decode", C, isa="avx512" if wide else _lane8_isa(built),
                            note=_ops_note("attention"))
    else:
        decode = KernelInfo("attention_decode", TORCH, op="sdpa", reason="no_kernel", note=f"no kernel for {what}")
    # NOTE: model/attention.py may attend every row of a prefill as a decode row (its
    # INVARIANT switch); read, not imported (kernels/ imports nothing of model/)
    invariant = getattr(sys.modules.get("stagewise.model.attention"), "INVARIANT", False)
    if decode.impl == C and invariant:
        prefill = replace(decode, family="attention_prefill", note=", ".join(
            x for x in ("each row as a decode row", decode.note) if x))
    elif attention.prefill_supports(q, q):
        prefill = KernelInfo("attention_prefill", C, isa="avx512_bf16" if "avx512_bf16" in built else
                             _vector_isa(built), op="sdpa", note="fresh prompts; cached prefixes on sdpa")
    else:
        prefill = KernelInfo("attention_prefill", TORCH, op="sdpa", reason="no_kernel", note=f"no kernel for {what}")
    return [decode, prefill]


def _norm(dtypes: set[torch.dtype]) -> KernelInfo:
    import torch

    from . import norm
    lib = _loaded(norm._load)
    if lib is None:
        reason, note = _why_missing("norm")
        return KernelInfo("norm", TORCH, op="rms_norm", reason=reason, note=note)
    others = sorted(_dtype_name(d) for d in dtypes - {torch.float32, torch.bfloat16})
    if others and len(others) == len(dtypes):
        return KernelInfo("norm", TORCH, op="rms_norm", reason="no_kernel", note=f"no kernel for {', '.join(others)}")
    note = ", ".join(x for x in ("eager steps", _ops_note("norm")) if x)
    return KernelInfo("norm", C, isa=_vector_isa(build.isa_of(lib)), note=note)


def _rope(dtypes: set[torch.dtype], normed: set[torch.dtype]) -> KernelInfo:
    import torch

    from . import rope
    lib = _loaded(rope._load)
    if lib is None:
        reason, note = _why_missing("rope")
        return KernelInfo("rope", TORCH, op="rope+index_copy", reason=reason, note=note)
    if not dtypes & {torch.float32, torch.bfloat16}:
        why = "q/k normed before rope" if normed else "no kernel for " + ", ".join(sorted(map(_dtype_name, dtypes)))
        return KernelInfo("rope", TORCH, op="rope+index_copy", reason="no_kernel", note=why)
    note = ", ".join(x for x in ("eager steps, with the KV cache write", _ops_note("rope")) if x)
    return KernelInfo("rope", C, isa=_vector_isa(build.isa_of(lib)), note=note)


def _comm(group: Any, hypothetical: bool) -> KernelInfo:
    lib = _comm_lib() if hypothetical or type(group).__name__ == "ShmGroup" else None
    if lib is None:
        reason, note = _why_missing("comm")
        if not hypothetical and build.mode() != "off" and "comm" not in build.failures:
            reason, note = "no_kernel", f"the group is {type(group).__name__}"
        return KernelInfo("comm", TORCH, op="gloo", reason=reason, note=note)
    return KernelInfo("comm", C, isa="", note=", ".join(x for x in ("shared memory", _ops_note("comm")) if x))


def _comm_lib() -> Any:
    from . import comm  # the collectives' ops: registered only where asked
    return _loaded(comm._load)


def _team() -> KernelInfo:
    from . import team
    lib = _loaded(team.library)
    if lib is None:
        reason, note = _why_missing("threads")
        return KernelInfo("team", TORCH, op="openmp", reason=reason, note=note)
    size = team.size()
    return KernelInfo("team", C, note=f"{size} threads" if size else "not started: OpenMP threads")


def as_dicts(report: list[KernelInfo]) -> list[dict]:
    """The report as plain dicts (the engine's stats snapshot)."""
    return [asdict(k) for k in report]


def summary(kernels: list[dict]) -> str:
    """`stats()["kernels"]` as one line for people: `kernels: <stage 0's>` (`; stage 1: ...` per stage)."""
    stages: dict[int, list[KernelInfo]] = {}
    for k in kernels:
        stages.setdefault(int(k.get("stage", 0)), []).append(KernelInfo(**k))
    if len(stages) <= 1:
        return f"kernels: {describe(next(iter(stages.values()), []))}"
    return "kernels: " + "; ".join(f"stage {i}: {describe(ks)}" for i, ks in sorted(stages.items()))
