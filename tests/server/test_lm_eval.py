"""lm-evaluation-harness end to end: `lm_eval --model local-completions` against the server and
`lm_eval --model hf` on the same checkpoint (fp32, CPU) run a small multiple-choice task
(loglikelihood: echo + logprobs) and a small generate_until task; every item's log-likelihood,
is-greedy flag, generation and score must agree. Where the model's greedy next token after a
question is a word, that item offers it as a choice, so the is-greedy flags are not all false."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORDS = "the cat dog sun moon river tree house star field road bird fish cloud stone".split()
LL_TOLERANCE = 1e-3
RUN_TIMEOUT_S = 240


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _greedy_word(tokenizer, model_dir, hf_logits, question: str) -> str | None:
    """The model's greedy next token as a choice (" word" after the question), if it is one."""
    ids = tokenizer.encode(question)
    token = int(hf_logits(model_dir, ids)[-1].argmax())
    text = tokenizer.decode([token])
    if not (text.startswith(" ") and text[1:].isalpha()) or tokenizer.encode(question + text) != ids + [token]:
        return None
    return text[1:]


def write_tasks(root: Path, model_dir: Path, hf_logits) -> tuple[str, str]:
    """Two local tasks (YAML + JSONL): 12 multiple-choice items, 6 generation items."""
    from transformers import AutoTokenizer
    tokenizer, rng = AutoTokenizer.from_pretrained(model_dir), random.Random(7)
    mc = []
    for i in range(12):
        question = _phrase(rng, 6)
        choices = [_phrase(rng, rng.randint(1, 3)) for _ in range(4)]
        greedy = _greedy_word(tokenizer, model_dir, hf_logits, question)
        if greedy is not None:
            choices[i % 4] = greedy
        mc.append({"question": question, "choices": choices, "answer": rng.randrange(4)})
    gen = [{"question": _phrase(rng, 5), "answer": rng.choice(WORDS)} for _ in range(6)]
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in gen))
    data = 'dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n' \
           'doc_to_text: "{{{{question}}}}"\n'
    (root / "sw_tiny_mc.yaml").write_text(
        "task: sw_tiny_mc\n" + data.format(path=root / "mc.jsonl") +
        'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (root / "sw_tiny_gen.yaml").write_text(
        "task: sw_tiny_gen\n" + data.format(path=root / "gen.jsonl") +
        'output_type: generate_until\ndoc_to_target: answer\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return "sw_tiny_mc", "sw_tiny_gen"


def lm_eval(tasks_dir: Path, out_dir: Path, log_path: Path, *model_args: str) -> subprocess.Popen:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(out_dir / "datasets-cache"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lm_eval", *model_args, "--tasks", "sw_tiny_mc,sw_tiny_gen",
           "--include_path", str(tasks_dir), "--log_samples", "--output_path", str(out_dir)]
    with open(log_path, "w") as log:          # the child keeps its own copy of the file
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def samples(out_dir: Path, task: str) -> list[dict]:
    [path] = out_dir.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def finish(proc: subprocess.Popen, log_path: Path) -> None:
    try:
        proc.wait(RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-4000:]


def test_lm_eval_against_the_server_equals_hf(server, client, llama_dir, hf_logits, tmp_path):
    tasks_dir, served, hf = tmp_path / "tasks", tmp_path / "served", tmp_path / "hf"
    for d in (tasks_dir, served, hf):
        d.mkdir()
    mc_task, gen_task = write_tasks(tasks_dir, llama_dir, hf_logits)
    name = client.models.list().data[0].id
    runs = [
        (lm_eval(tasks_dir, served, tmp_path / "served.log", "--model", "local-completions", "--model_args",
                 f"model={name},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                 f"tokenizer={llama_dir},num_concurrent=1,max_retries=1"), tmp_path / "served.log"),
        (lm_eval(tasks_dir, hf, tmp_path / "hf.log", "--model", "hf", "--model_args",
                 f"pretrained={llama_dir},dtype=float32", "--device", "cpu", "--batch_size", "1"),
         tmp_path / "hf.log"),
    ]
    for proc, log_path in runs:          # both at once: the served run mostly waits on the server
        finish(proc, log_path)

    got_mc, want_mc = samples(served, mc_task), samples(hf, mc_task)
    assert len(got_mc) == len(want_mc) == 12
    greedy_flags = []
    for got, want in zip(got_mc, want_mc):
        assert got["doc"] == want["doc"]
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got["filtered_resps"], want["filtered_resps"], strict=True):
            assert abs(float(g_ll) - float(w_ll)) < LL_TOLERANCE, (got["doc"], g_ll, w_ll)
            assert g_greedy == w_greedy, got["doc"]
            greedy_flags.append(g_greedy == "True")
        assert got["acc"] == want["acc"], got["doc"]
    assert any(greedy_flags) and not all(greedy_flags)      # the flags were put to the test both ways

    got_gen, want_gen = samples(served, gen_task), samples(hf, gen_task)
    assert len(got_gen) == len(want_gen) == 6
    assert [s["filtered_resps"] for s in got_gen] == [s["filtered_resps"] for s in want_gen]
    assert [s["exact_match"] for s in got_gen] == [s["exact_match"] for s in want_gen]
    assert any(s["filtered_resps"][0] for s in got_gen)      # something was generated
