"""GGUF LoRA files made by llama.cpp's own convert_lora_to_gguf.py from a PEFT adapter: greedy tokens and
logprobs equal PEFT's merged model (the file's q/k lora_b rows come permuted, as the base GGUF's q/k
rows do), on an HF base model in two stages and on a GGUF base model, given at start-up and loaded at
run time; a GGUF file that is not a LoRA adapter is one sentence naming it.

The converter comes from llama.cpp's source tree: $STAGEWISE_LLAMA_CPP_SRC, else the llama-cpp-python
sdist's vendor/llama.cpp under the cache (.ci/run unpacks it there); without it this test fails."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagewise import LLM, SamplingParams

pytest.importorskip("peft")
from lora_adapters import NEW_TOKENS, _make_adapter, merged_greedy  # noqa: E402

pytestmark = pytest.mark.slow

LLAMA_CPP_SDIST = "llama_cpp_python-0.3.36"
PROMPTS = [[(7 * i + 3) % 900 + 10 for i in range(21)], [(5 * i + 1) % 900 + 10 for i in range(9)]]
# every target llama.cpp maps, no rsLoRA (llama.cpp scales by alpha / r)
FIELDS = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])


def llama_cpp_src() -> Path:
    cache = Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise")
    src = Path(os.environ.get("STAGEWISE_LLAMA_CPP_SRC") or cache / "peers" / LLAMA_CPP_SDIST / "vendor" / "llama.cpp")
    if not (src / "convert_lora_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's convert_lora_to_gguf.py is not in {src}; unpack the {LLAMA_CPP_SDIST} sdist "
                    f"(pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36) there, as .ci/run does, "
                    f"or name a llama.cpp source tree in $STAGEWISE_LLAMA_CPP_SRC.")
    return src


@pytest.fixture(scope="module")
def adapter_pair(llama_dir, tmp_path_factory) -> tuple[str, str]:
    """(the PEFT directory, the GGUF file llama.cpp's converter made of it)."""
    root = tmp_path_factory.mktemp("lora-gguf")
    _make_adapter(llama_dir, root / "peft", 7, **FIELDS)
    out = root / "adapter.gguf"
    subprocess.run([sys.executable, str(llama_cpp_src() / "convert_lora_to_gguf.py"), "--base", str(llama_dir),
                    "--outtype", "f32", "--outfile", str(out), str(root / "peft")],
                   check=True, capture_output=True, timeout=600)
    return str(root / "peft"), str(out)


def _check(outs, want):
    for out, (tokens, logp) in zip(outs, want):
        comp = out.outputs[0]
        assert comp.token_ids == tokens
        assert abs(comp.logprobs[0].logprob - float(logp[tokens[0]])) < 1e-4


@pytest.mark.parametrize("base,pp", [("hf", 2), ("gguf", 1)])
def test_gguf_lora_equals_peft_merged(llama_dir, adapter_pair, tmp_path, gguf_tools, base, pp):
    peft_dir, gguf_file = adapter_pair
    model = str(llama_dir)
    if base == "gguf":
        model = str(gguf_tools.write_gguf(llama_dir, tmp_path / "model.gguf"))
    want = [merged_greedy(llama_dir, peft_dir, ids) for ids in PROMPTS]
    assert any(w[0] != merged_greedy(llama_dir, None, ids)[0] for w, ids in zip(want, PROMPTS))   # it matters
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(model=model, pp_size=pp, lora_modules=[f"g={gguf_file}"], enable_lora_runtime_updates=True) as llm:
        _check(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request="g", use_tqdm=False), want)
        llm.load_lora("late", gguf_file)
        _check(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, lora_request="late", use_tqdm=False),
               want)
        if base == "gguf":
            with pytest.raises(ValueError, match="'base': .* not a LoRA adapter"):
                llm.load_lora("base", model)
