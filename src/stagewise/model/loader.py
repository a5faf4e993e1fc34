"""Load one pipeline stage of a Hugging Face checkpoint directory or a GGUF file.

Owns checkpoint validation, dtype resolution, the quantization mode and stage-only safetensors
reads: the module is built on the meta device (no random init) with its quantized layers in place
(`stage_skeleton`, which `stagewise plan` sizes too), then only this stage's tensors are read from
disk (GGUF tensors by `model.gguf`).
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, cast

import torch
from torch import nn

from stagewise.checkpoint.facts import read_facts
from stagewise.checkpoint.files import CONTENTS as _CONTENTS
from stagewise.checkpoint.files import INDEX_FILE, SINGLE_FILE, gguf_file_of
from stagewise.checkpoint.files import require as _require
from stagewise.errors import CheckpointNotFoundError
from stagewise.kernels import build as kernel_build
from stagewise.model import cpu_gemm
from stagewise.model.gguf import gguf_scheme, load_gguf_stage
from stagewise.model.layers import StageModel
from stagewise.model.quantized import QuantEmbedding, QuantLinear, Scheme, kind_scheme, quantize_modules, weight_bytes
from stagewise.model.registry import get_model_class
from stagewise.parallel import tp as tensor_parallel
from stagewise.parallel.partition import StageInfo

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}

log = logging.getLogger("stagewise.loader")

BF16_MIN_HIDDEN = 256


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: str | torch.device = "cpu") -> torch.dtype:
    """`auto` on CPU: bfloat16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16 in
    /proc/cpuinfo) and the model is wide enough (hidden size >= BF16_MIN_HIDDEN) for matmuls to
    outweigh the per-op cost bf16 adds, else float32 (so tiny test models stay float32). Measured
    with OpenMP's default wait policy, bf16 won every figure from hidden 256 up (decode, prefill,
    offline), and lost batch-32 decode at hidden 128. On accelerators:
    the checkpoint's dtype, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            native_bf16 = kernel_build.native_bf16()     # no flags to read (not Linux): False, the safe choice
            wide = (getattr(hf_config, "hidden_size", None) or 0) >= BF16_MIN_HIDDEN
            return torch.bfloat16 if native_bf16 and wide and torch.backends.mkldnn.is_available() else torch.float32
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = _DTYPES.get(saved)
        return saved if saved in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16.")
    return _DTYPES[dtype]


def tensor_locations(model_dir: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (reads headers/index only)."""
    path = Path(model_dir)
    index, single = path / INDEX_FILE, path / SINGLE_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / fname for name, fname in weight_map.items()}
        for fpath in sorted(set(files.values())):
            _require(fpath, f"Shard listed in {INDEX_FILE}:")
        return files
    if single.exists():
        from safetensors import safe_open  # lazy: a GGUF model's process never needs it
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointNotFoundError(f"No weights in {path}: neither {SINGLE_FILE} nor {INDEX_FILE} exists; "
                                  f"a checkpoint directory must contain {_CONTENTS}.")


# NOTE: below this hidden size `auto` runs quantized layers exact: a small model's greedy answers sit
# near ties that 8-bit activations tip (the default 135M model answers "L'Étoile..." instead of
# "Paris" on AVX2 and AVX-512 alike), and its tokens cost a few milliseconds either way.
EXACT_MAX_HIDDEN = 1024


def exact_mode(dtype: str | torch.dtype, hf_config) -> bool:
    """Quantized weights run exact (float32 activations, never quantized: the numbers of the same
    weights dequantized to float32) when float32 was asked for by name (`--dtype float32`,
    `torch.float32`), or under `auto` for a model of hidden size below EXACT_MAX_HIDDEN; otherwise
    (`auto` on a wider model, bfloat16 and float16 by name) the kernels' fast mode (activations
    quantized to 8 bits per block)."""
    if dtype in (torch.float32, "float32", "fp32"):
        return True
    return dtype == "auto" and (getattr(hf_config, "hidden_size", None) or 0) < EXACT_MAX_HIDDEN


def quantization_scheme(model_dir: str | Path, quantization: str | None,
                        device: str | torch.device = "cpu") -> Scheme | None:
    """Which checkpoint tensors are held quantized: a GGUF file's own quantized types, or every
    matrix of a float checkpoint under `--quantization int8|int4`; None: none. The quantized kernels
    are CPU kernels: on another device a GGUF file is dequantized into the engine dtype."""
    gguf_path = gguf_file_of(model_dir)
    if torch.device(device).type != "cpu":
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} runs on the CPU (stagewise's quantized kernels are CPU "
                             f"kernels); on {torch.device(device).type} drop it or pass --device cpu.")
        return None
    if gguf_path is not None:
        if quantization is not None:
            raise ValueError(f"--quantization {quantization} quantizes float checkpoints at load, but {gguf_path.name} "
                             f"is a GGUF file whose tensors keep the types they are stored in; drop --quantization.")
        return gguf_scheme(gguf_path)
    return kind_scheme(quantization) if quantization is not None else None


def stage_skeleton(model_dir: str | Path, stage: StageInfo, dtype: torch.dtype, *, quantization: str | None = None,
                   exact: bool = True, tp: tuple[int, int] | None = None,
                   device: str | torch.device = "cpu") -> StageModel:
    """This stage's model on the meta device, its quantized layers in place (sizes as stored); `tp`
    (rank, size): only that tensor-parallel rank's slices (parallel/tp.py)."""
    hf_config = read_facts(model_dir).hf
    cls = get_model_class(_architecture(hf_config, model_dir))
    if stage.num_layers != hf_config.num_hidden_layers:
        raise ValueError(f"Stage {stage.rank} was planned for {stage.num_layers} layers, but {model_dir} has "
                         f"{hf_config.num_hidden_layers}.")
    scheme = quantization_scheme(model_dir, quantization, device)
    with torch.device("meta"):
        model = cast(StageModel, cls(hf_config, stage, dtype))
    if tp is not None and tp[1] > 1:
        tensor_parallel.shard(model, *tp)
    quantize_modules(model, scheme, exact)
    return model


def load_model(model_dir: str | Path, stage: StageInfo, dtype: str | torch.dtype,
               device: str | torch.device = "cpu", tp: tuple[int, int] | None = None, *,
               quantization: str | None = None, exact: bool | None = None) -> nn.Module:
    """Build this stage's model from `model_dir`, reading only the tensors the stage owns. Eval mode, no grad.
    `tp` (rank, size): only that tensor-parallel rank's slices (parallel/tp.py); `quantization`: int8 |
    int4 for a float checkpoint; `exact` (default: `exact_mode(dtype, ...)`) for quantized layers."""
    hf_config = read_facts(model_dir).hf
    gguf_path = gguf_file_of(model_dir)
    locations = tensor_locations(model_dir) if gguf_path is None else None
    resolved = resolve_dtype(dtype, hf_config, device)
    model = stage_skeleton(model_dir, stage, resolved, quantization=quantization,
                           exact=exact_mode(dtype, hf_config) if exact is None else exact, tp=tp, device=device)
    _to_empty(model, device)
    model.reset_buffers()
    with _one_thread():
        if gguf_path is not None:
            load_gguf_stage(model, gguf_path, hf_config)
        else:
            assert locations is not None   # read above for every checkpoint that is not a GGUF file
            _load_stage_tensors(model, locations, stage, Path(model_dir))
    model.eval()
    model.requires_grad_(False)
    _log_quantized(model, stage, quantization)
    packed = cpu_gemm.pack_linears(model)
    if packed:
        log.info("stage %d: %d %s linear weights prepacked for the CPU kernels (STAGEWISE_PACKED_WEIGHTS=0: off)",
                 stage.rank, packed, str(model.dtype).removeprefix("torch."))
    return model


@contextmanager
def _one_thread() -> Iterator[None]:
    """Loading runs many small tensor ops (repacking quantized blocks, a few MiB each): with intra-op
    threads on a busy machine each op waits for its threads (a 1B Q4_K_M stage took 9x longer with
    2 threads than with 1 while other processes ran)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _log_quantized(model, stage: StageInfo, quantization: str | None) -> None:
    held = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    if held:
        mode = "exact (float32 activations)" if held[0].exact else "fast (8-bit activations)"
        log.info("stage %d: %d layers held quantized%s, %.1f MiB of weights; kernels in %s mode", stage.rank,
                 len(held), f" ({quantization} at load)" if quantization else "", weight_bytes(model) / 2**20, mode)


def _to_empty(model: nn.Module, device: str | torch.device) -> None:
    """`model.to_empty(device=device)` by `torch.empty_strided`: torch.empty_like of a meta tensor runs
    torch._refs' Python version, whose first call imports sympy (~34 MB resident, ~450 modules)."""
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


def _architecture(hf_config, model_dir) -> str:
    archs = getattr(hf_config, "architectures", None)
    if not archs:
        raise ValueError(f"{Path(model_dir) / 'config.json'} names no architecture; add e.g. "
                         f'"architectures": ["LlamaForCausalLM"].')
    return archs[0]


def _load_stage_tensors(model, locations: dict[str, Path], stage: StageInfo, model_dir: Path) -> None:
    table = model.weight_table()
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, fpath in locations.items():
        if model.is_stage_weight(name):
            by_file[fpath].append(name)
    found = {model.canonical_name(n) for names in by_file.values() for n in names}
    missing = sorted(set(table) - found)
    if missing:
        raise ValueError(f"Checkpoint tensor {missing[0]} (shape {table[missing[0]].shape}) is missing from "
                         f"{model_dir}; stage {stage.rank} needs it "
                         f"({len(missing)} missing in all). The weights do not match config.json.")
    from safetensors import safe_open
    for fpath, names in by_file.items():
        with safe_open(str(fpath), framework="pt", device="cpu") as f:
            for name in names:
                _check_shape(f, fpath, name, table[model.canonical_name(name)].shape)
                model.load_weights([(name, f.get_tensor(name))])


def _check_shape(f, fpath: Path, name: str, expected: tuple[int, ...]) -> None:
    actual = tuple(f.get_slice(name).get_shape())
    if actual != expected:
        raise ValueError(f"Tensor {name} in {fpath} has shape {actual}, but config.json implies {expected}; "
                         f"the checkpoint and its config do not match.")
