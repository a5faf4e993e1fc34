"""Speculation with a draft model (`{"method": "draft_model", "model": ...}`): a small model of the
same tokenizer drafts k tokens per request beside the driver, the pipeline verifies them in one pass.
Greedy tokens equal the engine's without speculation, whether the draft agrees (the served model
drafting for itself) or mostly not (another random model), at PP=1 and over two stage processes; a
draft of another tokenizer, or one that cannot start, is one sentence."""
import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.speculative import vocabulary_mismatch
from tests.conftest import build_tiny_checkpoint

PROMPTS = [[900, 156, 948, 42, 865, 85, 922, 719], list(range(10, 15)), [(7 * i) % 900 + 3 for i in range(37)]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llama_dir):
    with LLM(model=str(llama_dir)) as llm:
        return tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A llama of the same shape and tokenizer with other random weights: its drafts are mostly wrong."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("draft-other"), "llama", tiny_tokenizer_dir, seed=7)


def _spec(path, k=4):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def _run(llama_dir, draft, **options):
    with LLM(model=str(llama_dir), speculative_config=_spec(draft), **options) as llm:
        got = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False))
        return got, llm.stats()["speculative"]


def test_the_served_model_drafting_for_itself_keeps_tokens_and_is_accepted(llama_dir, reference):
    got, spec = _run(llama_dir, llama_dir)
    assert got == reference
    assert spec["proposed"] > 0 and spec["accepted"] >= 0.8 * spec["proposed"]
    assert spec["mean_accepted_length"] > 2.5           # one pass yields several tokens


def test_a_disagreeing_draft_keeps_tokens(llama_dir, other_draft_dir, reference):
    got, spec = _run(llama_dir, other_draft_dir)
    assert got == reference
    assert spec["proposed"] > 0 and spec["accepted"] < spec["proposed"]     # rejections were exercised


@pytest.mark.slow
def test_drafts_verified_through_two_stage_processes(llama_dir, reference):
    got, spec = _run(llama_dir, llama_dir, pp_size=2)
    assert got == reference
    assert spec["accepted"] >= 0.8 * spec["proposed"] > 0


def test_a_draft_that_cannot_start_is_one_sentence(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="speculative_config model .* could not be started") as info:
        LLM(model=str(llama_dir), speculative_config=_spec(tmp_path / "missing"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad, words", [
    ({"method": "draft_model"}, "needs a model"),
    ({"method": "ngram", "model": "x"}, "none with ngram"),
    ({"model": "x", "draft_kv_cache_memory": "lots"}, "not a size"),
])
def test_draft_config_errors_are_one_sentence(bad, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs(speculative_config=bad)


def test_vllm_spelling_without_method_means_a_draft_model():
    spec = EngineConfig.from_kwargs(speculative_config={"model": "x", "num_speculative_tokens": 3})
    assert spec.scheduler.speculative_config.method == "draft_model"


def test_vocabularies_compare_on_the_ids_both_have():
    assert vocabulary_mismatch({"a": 0, "b": 1, "c": 2}, {"a": 0, "b": 1}) == ""
    assert "token 1" in vocabulary_mismatch({"a": 0, "b": 1}, {"a": 0, "x": 1})


def test_a_draft_of_another_tokenizer_is_one_sentence(llama_dir, tmp_path):
    """The same model with two tokens' ids swapped in its tokenizer.json."""
    import json
    import shutil
    draft = shutil.copytree(llama_dir, tmp_path / "swapped")
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (w for w, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="has another tokenizer") as info:
        LLM(model=str(llama_dir), speculative_config=_spec(draft))
    assert "token 300" in str(info.value) and "\n" not in str(info.value)


def test_a_draft_named_like_a_model_flag_is_resolved_like_one(llama_dir):
    """`demo` names the tiny demo checkpoint, as --model demo does (its tokenizer is the test one's)."""
    with LLM(model=str(llama_dir), speculative_config=_spec("demo")) as llm:
        assert llm.engine.speculator.draft.model_dir != "demo"
