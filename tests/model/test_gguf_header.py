"""The GGUF header reader (`gguf_meta._read_header`): the same metadata and tensor table as gguf's
GGUFReader on real files, large tokenizer arrays skipped rather than built, and one sentence for a
file cut anywhere."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from stagewise.checkpoint import gguf_meta
from stagewise.model.source import default_model_path


def _facts(path: Path) -> gguf_meta.GGUFFacts:
    return gguf_meta._gguf_facts_uncached(str(path), path.stat().st_size)


def _assert_matches_gguf_reader(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    facts = _facts(path)
    assert facts.meta == {key: field.contents() for key, field in reader.fields.items()
                          if key not in gguf_meta._GGUF_BIG_FIELDS and not key.startswith("GGUF.")}
    assert facts.tensors == tuple(gguf_meta.GGUFTensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape),
                                                       int(t.data_offset), int(t.n_bytes)) for t in reader.tensors)
    assert facts.types == {t.name: t.tensor_type.name for t in reader.tensors}
    rope = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    assert facts.rope_freqs == (None if rope is None else rope.data.astype("float64").tolist())


@pytest.mark.parametrize("family,qtype", [("llama", "F32"), ("llama", "Q8_0"), ("qwen3", "F32"), ("gpt2", "Q4_0")])
def test_header_matches_gguf_reader_on_written_files(family, qtype, tiny_gguf):
    _assert_matches_gguf_reader(tiny_gguf(family, qtype))


def test_header_matches_gguf_reader_on_the_default_model():
    path = default_model_path()
    if not path.is_file():
        pytest.skip("the default model is not cached here")
    _assert_matches_gguf_reader(path)


def test_large_tokenizer_arrays_are_skipped_not_built(tmp_path):
    """GGUFReader builds numpy views per array item (~150 MB for a 49k vocabulary); the header reader
    keeps only the small values, so reading 200k tokens and merges allocates well under a megabyte."""
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list([f"tok{i}" for i in range(200_000)])
    writer.add_token_merges([f"t {i}" for i in range(200_000)])
    writer.add_token_scores([0.0] * 200_000)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # measured in a fresh process: tracemalloc counts every thread's allocations (this one's may run engines)
    measure = ("import sys, tracemalloc, gguf; from stagewise.checkpoint import gguf_meta; tracemalloc.start(); "
               "facts = gguf_meta._gguf_facts_uncached(sys.argv[1], int(sys.argv[2])); "
               "print(tracemalloc.get_traced_memory()[1], facts.meta['llama.block_count'], len(facts.meta))")
    done = subprocess.run([sys.executable, "-c", measure, str(path), str(path.stat().st_size)], check=True,
                          capture_output=True, text=True)
    peak, blocks, n_meta = (int(v) for v in done.stdout.split())
    assert blocks == 1 and n_meta == len(_facts(path).meta) and "tokenizer.ggml.tokens" not in _facts(path).meta
    assert peak < 512 * 1024, f"reading the header allocated {peak} bytes"


def test_a_file_cut_anywhere_gets_one_sentence(tiny_gguf, tmp_path):
    data = tiny_gguf("llama", "Q8_0").read_bytes()
    cut_file = tmp_path / "cut.gguf"
    for cut in sorted({*range(4, 400, 7), *range(400, len(data), max(1, len(data) // 60))}):
        cut_file.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"is truncated or damaged \(.*\); download or convert it again\.$"):
            _facts(cut_file)


def test_impossible_counts_are_refused_before_reading(tmp_path):
    """A count or length larger than the file is an error at once, not a huge allocation or loop."""
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    key = (4).to_bytes(8, "little") + b"key." + (9).to_bytes(4, "little")     # an array ...
    for body in (key + (8).to_bytes(4, "little") + (2 ** 62).to_bytes(8, "little"),      # of 2^62 strings
                 key + (4).to_bytes(4, "little") + (2 ** 40).to_bytes(8, "little"),      # of 2^40 uint32s
                 (2 ** 50).to_bytes(8, "little") + b"x" * 16):                            # a 2^50-byte key
        path = tmp_path / "bad.gguf"
        path.write_bytes(header + body)
        with pytest.raises(ValueError, match="is truncated or damaged"):
            _facts(path)


def test_the_type_table_matches_gguf_py():
    """gguf_meta's own GGML type numbers and block sizes are gguf-py's, for every type either knows."""
    ours = {t.name: (int(t), gguf_meta.GGML_SIZES[t]) for t in gguf_meta.GGMLType}
    theirs = {t.name: (int(t), gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert ours == theirs


def test_loading_a_quantized_file_does_not_import_gguf_py(tiny_gguf):
    """The header reader, the type table and the float tensors (F32 norms) need no gguf-py (~2 MiB
    resident with its YAML reader): a Q8_0 file loads and runs without it."""
    path = tiny_gguf("llama", "Q8_0")
    run = ("import sys; from stagewise import LLM, SamplingParams\n"
           "if __name__ == '__main__':\n"
           "    llm = LLM(model=sys.argv[1], device='cpu', prefill_graph='off', kv_cache_memory='16MiB')\n"
           "    out = llm.generate(prompt_token_ids=[[5, 9, 14]], sampling_params=SamplingParams(max_tokens=3))\n"
           "    print(len(out[0].outputs[0].token_ids), sorted(m for m in sys.modules if m.split('.')[0] == 'gguf'))\n"
           "    llm.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", run, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "3 []"
