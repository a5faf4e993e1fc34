"""Random-weight GGUF files with the real tensor shapes of the models people split over machines:
Qwen3-30B-A3B (qwen3moe, 128 experts top-8; cut to `--layers`, every layer the real shape), the
same shape with its active parameters as one dense MLP (`qwen3-30b-a3b-active`, the MoE's dense
twin), Mixtral 8x7B (llama with expert tensors) and a dense Llama-3.1-8B, in a Q4_K_M-like mix
(Q4_K, with Q6_K for attn_v, ffn_down and the output); gpt-oss-20b (32 experts top-4) as its
released file holds it: MXFP4 experts, Q8_0 attention, embeddings and output, float biases, norms
and sinks. Speed does not depend on weight values, so random blocks valid for their type (small
scales, random codes) are an honest workload. Written tensor by tensor (at most one tensor in
memory), so a file never needs the whole model in RAM.

    python -m benchmarks.quantized make-shapes --shape qwen3-30b-a3b --layers 8 --out DIR

The files carry a byte-level GPT-2 vocabulary (llama.cpp and stagewise both read it); the benchmark
runs them by prompt token ids (`python -m benchmarks.quantized run --files PATH.gguf,...`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

# name -> (arch, hidden, layers, heads, kv heads, head dim, dense intermediate, vocab, experts, used, expert inter)
SHAPES = {
    "qwen3-30b-a3b": ("qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, 128, 8, 768),
    "mixtral-8x7b": ("llama", 4096, 32, 32, 8, 128, 14336, 32000, 8, 2, 14336),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 128, 14336, 128256, 0, 0, 0),
    # Qwen3-30B-A3B's active parameters as a dense model: 8 experts x 768 rows = one 6,144-row MLP
    "qwen3-30b-a3b-active": ("qwen3", 2048, 48, 32, 4, 128, 6144, 151936, 0, 0, 0),
    "gpt-oss-20b": ("gpt-oss", 2880, 24, 64, 8, 64, 2880, 201088, 32, 4, 2880),
}
_GPT_OSS_WINDOW = 128
_SCALE = 0.002          # every block's fp16 scale: small values, as a trained model's


def _random_blocks(rng, shape: tuple[int, ...], qtype) -> object:
    """Random bytes of `shape` (torch order) in `qtype`, each block's scale fields set small."""
    import gguf
    import numpy as np
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    raw = rng.integers(0, 256, size=byte_shape, dtype=np.uint8)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, block_bytes)
    scale = np.frombuffer(np.float16(_SCALE).tobytes(), dtype=np.uint8)
    if qtype.name == "MXFP4":       # one E8M0 exponent byte per block: 2**-9 keeps |w| <= 0.012
        blocks[:, 0] = 118
        return raw
    offsets = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (block_bytes - 2,)}[qtype.name]
    for off in offsets:
        blocks[:, off:off + 2] = scale
    return raw


def _tensors(shape_name: str, layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, torch-order shape, type) of every tensor, in file order."""
    from gguf.constants import MODEL_TENSOR as M
    from gguf.constants import TENSOR_NAMES
    arch, hidden, _, heads, kv, head_dim, inter, vocab, experts, _, e_inter = SHAPES[shape_name]
    name = lambda t, bid=None: TENSOR_NAMES[t].format(bid=bid) + ".weight"
    if arch == "gpt-oss":
        return _gpt_oss_tensors(shape_name, layers)
    out = [(name(M.TOKEN_EMBD), (vocab, hidden), "Q4_K")]
    for b in range(layers):
        out += [(name(M.ATTN_NORM, b), (hidden,), "F32"), (name(M.ATTN_Q, b), (heads * head_dim, hidden), "Q4_K"),
                (name(M.ATTN_K, b), (kv * head_dim, hidden), "Q4_K"),
                (name(M.ATTN_V, b), (kv * head_dim, hidden), "Q6_K"),
                (name(M.ATTN_OUT, b), (hidden, heads * head_dim), "Q4_K"), (name(M.FFN_NORM, b), (hidden,), "F32")]
        if arch in ("qwen3moe", "qwen3"):
            out += [(name(M.ATTN_Q_NORM, b), (head_dim,), "F32"), (name(M.ATTN_K_NORM, b), (head_dim,), "F32")]
        if experts:
            out += [(name(M.FFN_GATE_INP, b), (experts, hidden), "F32"),
                    (name(M.FFN_GATE_EXP, b), (experts, e_inter, hidden), "Q4_K"),
                    (name(M.FFN_UP_EXP, b), (experts, e_inter, hidden), "Q4_K"),
                    (name(M.FFN_DOWN_EXP, b), (experts, hidden, e_inter), "Q6_K")]
        else:
            out += [(name(M.FFN_GATE, b), (inter, hidden), "Q4_K"), (name(M.FFN_UP, b), (inter, hidden), "Q4_K"),
                    (name(M.FFN_DOWN, b), (hidden, inter), "Q6_K")]
    return out + [(name(M.OUTPUT_NORM), (hidden,), "F32"), (name(M.OUTPUT), (vocab, hidden), "Q6_K")]


def _gpt_oss_tensors(shape_name: str, layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss's tensors: every projection with its bias, one sink logit per head, a post-attention
    norm instead of an FFN norm, and a biased router over MXFP4 experts."""
    from gguf.constants import MODEL_TENSOR as M
    from gguf.constants import TENSOR_NAMES
    _, hidden, _, heads, kv, head_dim, _, vocab, experts, _, e_inter = SHAPES[shape_name]
    base = lambda t, bid=None: TENSOR_NAMES[t].format(bid=bid)
    out = [(base(M.TOKEN_EMBD) + ".weight", (vocab, hidden), "Q8_0")]
    for b in range(layers):
        out += [(base(M.ATTN_NORM, b) + ".weight", (hidden,), "F32"),
                (base(M.ATTN_POST_NORM, b) + ".weight", (hidden,), "F32"),
                (base(M.ATTN_SINKS, b) + ".weight", (heads,), "F32")]
        for t, rows, cols in ((M.ATTN_Q, heads * head_dim, hidden), (M.ATTN_K, kv * head_dim, hidden),
                              (M.ATTN_V, kv * head_dim, hidden), (M.ATTN_OUT, hidden, heads * head_dim)):
            out += [(base(t, b) + ".weight", (rows, cols), "Q8_0"), (base(t, b) + ".bias", (rows,), "F32")]
        out += [(base(M.FFN_GATE_INP, b) + ".weight", (experts, hidden), "F32"),
                (base(M.FFN_GATE_INP, b) + ".bias", (experts,), "F32")]
        for t, rows, cols in ((M.FFN_GATE_EXP, e_inter, hidden), (M.FFN_UP_EXP, e_inter, hidden),
                              (M.FFN_DOWN_EXP, hidden, e_inter)):
            out += [(base(t, b) + ".weight", (experts, rows, cols), "MXFP4"),
                    (base(t, b) + ".bias", (experts, rows), "F32")]
    return out + [(base(M.OUTPUT_NORM) + ".weight", (hidden,), "F32"),
                  (base(M.OUTPUT) + ".weight", (vocab, hidden), "Q8_0")]


def _metadata(writer, shape_name: str, layers: int) -> None:
    arch, hidden, _, heads, kv, head_dim, inter, vocab, experts, used, e_inter = SHAPES[shape_name]
    writer.add_name(f"random {shape_name} ({layers} layers)")
    writer.add_context_length(131072 if arch == "gpt-oss" else 4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base({"qwen3moe": 1000000.0, "qwen3": 1000000.0, "gpt-oss": 150000.0}.get(arch, 500000.0))
    writer.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(used)
        if arch in ("qwen3moe", "gpt-oss"):
            writer.add_expert_feed_forward_length(e_inter)
    import gguf
    if arch == "gpt-oss":       # YaRN x32 over 4,096 positions; window layers of 128, as released
        writer.add_sliding_window(_GPT_OSS_WINDOW)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    # GPT-2's byte-level alphabet, two merges (llama.cpp refuses a BPE vocabulary without merges), fillers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + ["\u0120t", "\u0120a"] + [f"<|tok_{i}|>" for i in range(vocab - 258)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["\u0120 t", "\u0120 a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write(shape_name: str, layers: int, out: Path, seed: int = 0, log=print) -> Path:
    import gguf
    import numpy as np
    arch = SHAPES[shape_name][0]
    rng = np.random.default_rng(seed)
    tensors = _tensors(shape_name, layers)
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, shape_name, layers)
    for tname, shape, kind in tensors:
        qtype = gguf.GGMLQuantizationType[kind]
        byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype) if kind != "F32" else shape
        nbytes = int(np.prod(byte_shape)) * (1 if kind != "F32" else 4)
        writer.add_tensor_info(tname, byte_shape, np.dtype(np.uint8 if kind != "F32" else np.float32), nbytes,
                               raw_dtype=qtype if kind != "F32" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tname, shape, kind in tensors:
        if kind == "F32":
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if tname.endswith(("ffn_gate_inp.weight", ".bias")):
                data = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = _random_blocks(rng, shape, gguf.GGMLQuantizationType[kind])
        writer.write_tensor_data(data)
        del data
    writer.close()
    log(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB, {layers} layers of {shape_name})")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized make-shapes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--layers", type=int, default=None, help="layers to write (default: the model's all)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the .gguf file")
    args = parser.parse_args(argv)
    layers = args.layers or SHAPES[args.shape][2]
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.shape, layers, args.out / f"{args.shape}-{layers}l-random.gguf")
