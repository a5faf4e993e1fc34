"""A GGUF model runs without transformers in its process (issue 49: transformers adds ~190 MB
resident): its config is a `GGUFConfig` record and its tokenizer a `SavedTokenizer` (tokenizers +
jinja2), which must match transformers' config class and transformers' tokenizer built from the same
file: ids, decoded text, token strings and chat-template output, tools and special tokens included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jinja2
import pytest

from stagewise.checkpoint.files import load_hf_config, load_tokenizer
from stagewise.checkpoint.gguf_meta import config_fields_from_gguf
from stagewise.checkpoint.saved_tokenizer import SavedTokenizer
from stagewise.config import cache_root
from stagewise.model.layers import rope_parameters
from stagewise.model.source import ensure_default_model

SRC = Path(__file__).resolve().parents[2] / "src"
MISSING = object()
# every attribute stagewise reads off a model config (grep hf_config / hf in src/stagewise)
READ_ATTRS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
              "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings", "sliding_window",
              "use_sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "n_embd", "n_layer",
              "n_head", "n_inner", "n_positions", "layer_norm_epsilon", "activation_function", "scale_attn_weights",
              "scale_attn_by_inverse_layer_idx", "vision_config", "text_config", "multimodal_config")
TEXTS = ["The pipeline has four stages.", "  leading spaces,\ttabs and\nnew\n\nlines  ", "ünïcödé — 東京 🚀 123456",
         "def f(x):\n    return x ** 2  # comment", "<|user|>special tokens<|eos|> in text<|assistant|>",
         "<|im_start|>user\nHi<|im_end|>", "a", " ", ""]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "The city, e.g. Paris"}},
                                               "required": ["city"]}}}]
# exercises what transformers' template environment adds: tools and tojson, namespace, loop controls,
# raise_exception, strftime_now, dict, {% generation %}, documents, extra variables, special tokens
TOOL_TEMPLATE = """{%- set ns = namespace(count=0) -%}
{%- if tools %}{{ bos_token }}<|system|>
Tools (a {{ strftime_now('%Y') | length }}-digit year):
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}{{ eos_token }}
{% endif %}
{%- for message in messages %}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('Unknown role: ' + message.role) }}
  {%- endif %}
  {%- set ns.count = ns.count + 1 %}
  {%- if message.role == 'assistant' %}
<|assistant|>
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif %}
{% generation %}{{ message.content }}{% endgeneration %}
    {%- for call in message.tool_calls or [] %}
      {%- if loop.index > 2 %}{% break %}{% endif %}
<tool_call>{{ call.function | tojson }}</tool_call>
    {%- endfor %}{{ eos_token }}
  {%- else %}
<|{{ message.role }}|>
{{ message.content }}{{ eos_token }}
  {%- endif %}
{%- endfor %}
{%- for doc in documents or [] %}
[{{ doc.title }}] {{ doc.text }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}
{{ dict(turns=ns.count) | tojson }}"""
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = [
    dict(conversation=[{"role": "user", "content": "Hi there"}], add_generation_prompt=True),
    dict(conversation=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": None, "tool_calls": [CALL, CALL, CALL]},
                       {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "<|im_end|> ü"}],
         tools=TOOLS, add_generation_prompt=True, enable_thinking=False),
    dict(conversation=[{"role": "user", "content": "Think"},
                       {"role": "assistant", "reasoning": "Hmm.", "content": "The answer is "}],
         continue_final_message=True),
    dict(conversation=[{"role": "user", "content": "Summarize"}], documents=[{"title": "A", "text": "one"}],
         add_generation_prompt=False),
]


def _transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _same_as_transformers(ours: SavedTokenizer, theirs, templates: list[str | None]) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.get_vocab() == theirs.get_vocab() and ours.special_tokens_map == theirs.special_tokens_map
    assert ours.chat_template == theirs.chat_template
    for template in templates:
        for case in CONVERSATIONS:
            want = _outcome(theirs.apply_chat_template, **case, chat_template=template, tokenize=False)
            assert _outcome(ours.apply_chat_template, **case, chat_template=template, tokenize=False) == want, case
            if isinstance(want, str):
                ids = ours.apply_chat_template(**case, chat_template=template)
                assert ids == theirs.encode(want, add_special_tokens=False)


def _outcome(render, **kwargs):
    """The text, or the error a template raised (the model's own may refuse a conversation, alike)."""
    try:
        return render(**kwargs)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)


def _same_refusals(ours: SavedTokenizer, theirs) -> None:
    bad_role = [{"role": "robot", "content": "beep"}]
    for template, messages, error in ((TOOL_TEMPLATE, bad_role, jinja2.exceptions.TemplateError),
                                      ("{% set ns = namespace(_x=1) %}", bad_role, jinja2.exceptions.SecurityError)):
        for tok in (ours, theirs):
            with pytest.raises(error) as caught:
                tok.apply_chat_template(messages, chat_template=template, tokenize=False)
            assert "robot" in str(caught.value) or "_x" in str(caught.value)
    for tok in (ours, theirs):
        with pytest.raises(ValueError):
            tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                    continue_final_message=True, tokenize=False)


@pytest.fixture(autouse=True)
def _private_cache(request, monkeypatch, tmp_path_factory):
    """Converted tokenizers of the throwaway fixtures go to a temp cache; the SmolLM2 tests keep the real one."""
    if "smollm2" not in request.fixturenames:
        monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path_factory.getbasetemp() / "stagewise-cache"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return ensure_default_model()


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_matches_transformers_on_a_byte_level_gguf(add_bos, llama_dir, tmp_path, gguf_tools):
    path = gguf_tools.write_gguf(llama_dir, tmp_path / f"bos-{add_bos}.gguf", add_bos=add_bos)
    ours, theirs = load_tokenizer(path), _transformers_tokenizer(path)
    assert isinstance(ours, SavedTokenizer) and (ours.encode("Hi")[0] == theirs.bos_token_id) == add_bos
    _same_as_transformers(ours, theirs, [None, TOOL_TEMPLATE])
    _same_refusals(ours, theirs)
    again = load_tokenizer(path)           # the second start reads the cached conversion
    assert again.encode(TEXTS[2]) == ours.encode(TEXTS[2]) and again.chat_template == ours.chat_template


def _write_sentencepiece_gguf(path: Path) -> Path:
    """A tokenizer-only GGUF with a llama (sentencepiece) vocabulary: byte fallback, scored pieces, BOS added."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzTHP.,!?'", "▁t", "▁th", "▁the", "he", "in", "er", "▁a", "an", "st",
              "ip", "ipe", "lin", "line", "▁p", "▁pip", "▁pipeline", "ag", "es", "▁s", "▁st", "▁stag", "▁stages"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(len(p)) if len(p) == 1 else float(len(p)) for p in pieces)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                             "{{ eos_token }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tokenizer_matches_transformers_on_a_sentencepiece_gguf(tmp_path):
    path = _write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours, theirs = load_tokenizer(path), _transformers_tokenizer(path)
    assert ours.encode("the pipeline")[0] == 1          # llama.cpp's sentencepiece default: BOS added
    _same_as_transformers(ours, theirs, [None, TOOL_TEMPLATE])


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_structured_outputs_see_the_vocabulary_transformers_gives(kind, tiny_gguf, tmp_path):
    """xgrammar reads a transformers tokenizer: a SavedTokenizer goes to it as one, to the same effect."""
    from stagewise.grammar.matchers import XGrammarBackend
    path = tiny_gguf("llama") if kind == "byte-level" else _write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours, theirs = load_tokenizer(path), _transformers_tokenizer(path)
    size = len(theirs.get_vocab())
    got, want = (XGrammarBackend(tok, size, (2,)).info for tok in (ours, theirs))
    assert (got.vocab_type, got.add_prefix_space, got.stop_token_ids) == (want.vocab_type, want.add_prefix_space, [2])
    assert got.decoded_vocab == want.decoded_vocab


@pytest.mark.parametrize("family", ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "gpt2", "gemma3_hd", "phi3",
                                    "phi4_mini", "qwen3_5"])
def test_config_record_reads_as_transformers_config(family, tiny_gguf):
    _same_config_as_transformers(tiny_gguf(family, "Q8_0"))


def _same_config_as_transformers(path: Path) -> None:
    import transformers
    arch, fields = config_fields_from_gguf(path)
    ours = load_hf_config(path)
    names = {"gpt2": "GPT2Config", "gemma3": "Gemma3TextConfig", "qwen35": "Qwen3_5TextConfig"}
    theirs = getattr(transformers, names.get(arch, f"{arch.capitalize()}Config"))(**fields)
    extra = {"gemma3": ("layer_types", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
                        "hidden_activation", "rope_parameters"),
             "phi3": ("original_max_position_embeddings",),
             "qwen35": ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                        "linear_num_key_heads", "linear_num_value_heads")}.get(arch, ())
    for name in READ_ATTRS + extra:
        assert getattr(ours, name, MISSING) == getattr(theirs, name, MISSING), name
    assert rope_parameters(ours) == rope_parameters(theirs)


def test_a_gguf_without_tokenizer_metadata_is_one_sentence(llama_dir, tmp_path, gguf_tools):
    path = gguf_tools.write_gguf(llama_dir, tmp_path / "bare.gguf", tokenizer=False)
    with pytest.raises(ValueError, match=r"^Could not build a tokenizer from the metadata of .*bare\.gguf \(.*\); "
                                         r"pass --tokenizer DIR with the model's tokenizer files\.$") as caught:
        load_tokenizer(path)
    assert "\n" not in str(caught.value)
    assert not list((cache_root() / "gguf-tokenizers").glob("bare-*"))


def test_a_damaged_cached_tokenizer_is_one_sentence(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"are missing or damaged .*; delete that directory"):
        SavedTokenizer.from_dir(tmp_path)


# ---- the process that runs a GGUF model -------------------------------------------------------

_GENERATE = """
import json, sys
from stagewise import LLM, SamplingParams
with LLM(model=sys.argv[1], prefill_graph="off") as llm:
    out = llm.generate(["The pipeline"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    chat = llm.engine.tok.chat_prompt([{"role": "user", "content": "Hi"}])
# cryptography: only pipeline links need it; safetensors: only checkpoint directories
heavy = ("transformers", "accelerate", "torch._dynamo", "sympy", "cryptography", "safetensors")
print(json.dumps({"tokens": len(out[0].outputs[0].token_ids), "chat": chat,
                  "loaded": sorted(m for m in heavy if m in sys.modules)}))
"""


def _run(code: str, *args: str, cache: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p))
    if cache is not None:
        env["STAGEWISE_CACHE"] = str(cache)
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generating_from_a_gguf_never_imports_transformers(family, tiny_gguf, tmp_path):
    path = tiny_gguf(family, "Q8_0")
    starts = ("first (converts the tokenizer)", "second (reads the cache)")
    for start in starts if family == "llama" else starts[:1]:
        got = _run(_GENERATE, str(path), cache=tmp_path / "cache")
        assert got["tokens"] == 4 and got["chat"].startswith("<|bos|><|user|>\nHi<|eos|>"), start
        # torch._dynamo and sympy neither: stages leave the meta device without torch._refs (model/loader.py)
        assert got["loaded"] == [], start


_CLI = """
import json, sys
from stagewise.cli import main
code = main(["--log-level", "WARNING", "generate", "--max-tokens", "4", *sys.argv[1:]])
print(json.dumps({"code": code, "loaded": sorted(m for m in ("transformers", "accelerate") if m in sys.modules)}))
"""


@pytest.mark.slow
def test_stagewise_generate_on_the_default_model_never_imports_transformers(smollm2):
    for flags in ((), ("--prefill-graph", "off")):
        assert _run(_CLI, *flags) == {"code": 0, "loaded": []}, flags


@pytest.mark.slow
def test_default_model_tokenizer_and_config_match_transformers(smollm2):
    _same_as_transformers(load_tokenizer(smollm2), _transformers_tokenizer(smollm2), [None, TOOL_TEMPLATE])
    _same_config_as_transformers(smollm2)
