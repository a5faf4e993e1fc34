"""Qwen3.5 (dense text: gated delta-rule linear-attention layers beside gated full attention) against
HF transformers (fp32): prompt logits and greedy tokens at PP=1 and PP=2 (the split between a linear
and a full-attention layer included), prompts in chunks that continue a state slot, batched steps of
several sequences, the state pool and the memory plan's count of it, the engine end to end, GGUF
`qwen35` files; and Qwen3-Next (the same kinds, other linear-layer projections, MoE MLPs)."""
from __future__ import annotations

import pytest
import torch

from stagewise.model.attention import AttentionMetadata

PROMPTS = [[5, 17, 230, 44, 9], [300, 12, 7, 99, 41, 8, 600, 3, 250, 77, 18, 512, 64, 2, 901, 33, 47],
           list(range(10, 410, 9)) + list(range(7, 400, 13))]    # 5, 17 and 76 tokens (two delta-rule chunks)
ATOL = 2e-4


def _chunked_logits(pipe, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """One prompt's logits computed in chunks ending at `cuts` (each continues the cache and the state)."""
    pipe.reset()
    rows, start = [], 0
    for end in [*cuts, len(ids)]:
        meta = AttentionMetadata.build([end - start], [end], [pipe.table(0)], pipe.block_size)
        rows.append(pipe.stages[-1].compute_logits(pipe.forward(torch.tensor(ids[start:end]),
                                                                torch.arange(start, end), meta)))
        start = end
    return torch.cat(rows)


@pytest.mark.parametrize("pp_size,partition", [(1, None), (2, [3, 1]), (2, [2, 2])])
def test_logits_and_greedy_match_hf(qwen3_5_dir, eager_pipeline, hf_logits, hf_greedy, pp_size, partition):
    """[3, 1]: the three linear layers on one stage, the full-attention layer on the next."""
    pipe = eager_pipeline(qwen3_5_dir, pp_size=pp_size, partition=partition)
    for ids in PROMPTS:
        torch.testing.assert_close(pipe.prefill_logits(ids), hf_logits(qwen3_5_dir, ids), atol=ATOL, rtol=0)
    assert [pipe.greedy(ids, 16) for ids in PROMPTS[1:]] == hf_greedy(qwen3_5_dir, PROMPTS[1:], 16)


def test_split_between_linear_and_full_attention_layers(qwen3_5_dir, eager_pipeline):
    first, second = eager_pipeline(qwen3_5_dir, pp_size=2, partition=[3, 1]).stages
    assert [first.layers[i].linear for i in range(3)] == [True] * 3 and not second.layers[3].linear
    assert sorted(first.state_spec()) == [0, 1, 2] and second.state_spec() == {}
    assert first.kv_layer_ids() == [] and second.kv_layer_ids() == [3]


def test_chunked_prefill_continues_the_state(qwen3_5_dir, eager_pipeline, hf_logits):
    """Chunks of 1, 30 and the rest (one-row chunks take the recurrent step, longer ones the chunked rule)."""
    pipe = eager_pipeline(qwen3_5_dir, pp_size=2, partition=[3, 1])
    ids = PROMPTS[2]
    want = hf_logits(qwen3_5_dir, ids)
    torch.testing.assert_close(_chunked_logits(pipe, ids, [1, 31]), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(_chunked_logits(pipe, ids, [64, 65]), want, atol=ATOL, rtol=0)


def test_batched_steps_keep_each_sequence_in_its_slot(qwen3_5_dir, eager_pipeline, hf_logits, hf_greedy):
    """Three prompts prefilled in one step, then decoded together (one batched recurrent step)."""
    pipe = eager_pipeline(qwen3_5_dir)
    pipe.reset()
    lens = [len(p) for p in PROMPTS]
    meta = AttentionMetadata.build(lens, lens, [pipe.table(i) for i in range(3)], pipe.block_size)
    hidden = pipe.forward(torch.tensor([t for p in PROMPTS for t in p]), torch.cat([torch.arange(n) for n in lens]),
                          meta)
    logits = pipe.stages[-1].compute_logits(hidden).split(lens)
    for ids, rows in zip(PROMPTS, logits):
        torch.testing.assert_close(rows, hf_logits(qwen3_5_dir, ids), atol=ATOL, rtol=0)
    outs = [[int(rows[-1].argmax())] for rows in logits]
    for step in range(9):
        seq_lens = [n + step + 1 for n in lens]
        meta = AttentionMetadata.build([1, 1, 1], seq_lens, [pipe.table(i) for i in range(3)], pipe.block_size)
        hidden = pipe.forward(torch.tensor([o[-1] for o in outs]), torch.tensor([n - 1 for n in seq_lens]), meta)
        for o, row in zip(outs, pipe.stages[-1].compute_logits(hidden)):
            o.append(int(row.argmax()))
    assert outs == hf_greedy(qwen3_5_dir, PROMPTS, 10)


def test_bfloat16_stages_run_as_transformers_bfloat16(qwen3_5_dir, eager_pipeline, hf_logits):
    """bf16 weights, activations and conv windows (the delta rule's state stays float32) against transformers
    in bf16: this random model moves ~2.5 logits from fp32 to bf16 in either, far less between the two."""
    from transformers import AutoModelForCausalLM
    full = hf_logits(qwen3_5_dir, PROMPTS[2])
    model = AutoModelForCausalLM.from_pretrained(qwen3_5_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPTS[2]])).logits[0].float()
    pipe = eager_pipeline(qwen3_5_dir, pp_size=2, partition=[3, 1], dtype=torch.bfloat16)
    half = pipe.prefill_logits(PROMPTS[2])
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert (half - theirs).abs().max() < 0.1 * (theirs - full).abs().max()
    conv, state = pipe.batches[0].states[0]
    assert conv.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_state_pool_slots_are_reused_and_grow():
    from stagewise.kvcache.state import StatePool, slot_bytes
    spec = {1: [((6, 3), torch.float32), ((2, 4, 4), torch.float32)]}
    pool = StatePool(spec, 3, 2)
    assert pool.layers[0] is None and [t.shape for t in pool.layers[1]] == [(2, 6, 3), (2, 2, 4, 4)]
    assert slot_bytes(spec) == (18 + 32) * 4
    a, b = pool.allocate(), pool.allocate()
    pool.layers[1][1][b].fill_(7.0)
    c = pool.allocate()                         # past the planned slots: grows, keeping what slots hold
    assert {a, b, c} == {0, 1, 2} and pool.num_slots == 4 and float(pool.layers[1][1][b].max()) == 7.0
    pool.release(a)
    assert pool.allocate() == a


def test_memory_plan_counts_the_state_and_only_attention_layers_hold_kv(qwen3_5_dir):
    from stagewise.checkpoint.facts import read_facts
    from stagewise.checkpoint.layer_kinds import state_bytes_per_request
    from stagewise.parallel.partition import stage_infos
    from stagewise.planning.memory import kv_bytes_per_block, recurrent_state_bytes
    hf = read_facts(qwen3_5_dir).hf
    whole, (first, second) = stage_infos(4, 1)[0], stage_infos(4, 2, [3, 1])
    # per linear layer: conv window (2*2*16 + 4*8) * 3 fp32 values, delta-rule state 4*16*8 fp32 values
    per_layer = (96 * 3 + 4 * 16 * 8) * 4
    assert state_bytes_per_request(hf, range(4), 4) == 3 * per_layer == recurrent_state_bytes(hf, whole, 4)
    assert recurrent_state_bytes(hf, second, 4) == 0 and recurrent_state_bytes(hf, first, 4) == 3 * per_layer
    one_layer = 2 * 16 * 2 * 16 * 4         # K and V, 16 positions, 2 KV heads of 16, fp32
    assert kv_bytes_per_block(whole, 2, 16, 16, torch.float32, hf_config=hf) == one_layer
    assert kv_bytes_per_block(whole, 2, 16, 16, torch.float32) == 4 * one_layer     # without the config: every layer


def test_plan_shows_the_state_per_request_and_kv_of_attention_layers_only(qwen3_5_dir, capsys):
    from stagewise.cli import main
    assert main(["plan", "--model", str(qwen3_5_dir), "--pp-size", "2", "--pp-layer-partition", "3,1",
                 "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))}
    head = next(line for line in out.splitlines() if line.startswith("stage"))
    assert "activations MiB  state MiB  KV MiB" in head
    state_col = 7                                # stage, layers, 5 columns of MiB, then the state's
    assert float(rows["[0,3)"][state_col]) > 0 and float(rows["[3,4)"][state_col]) == 0
    per_request = 3 * (96 * 3 + 4 * 16 * 8) * 4
    assert f"recurrent state: {per_request:,} bytes" in out and "over its 1 attention layers of 4" in out


@pytest.mark.parametrize("flags", [dict(prefill_graph="compiled"), dict(prefill_graph="full"),
                                   dict(decode_graph=True)])
def test_graphs_are_refused_in_one_sentence_and_auto_runs_eager(qwen3_5_dir, flags):
    from stagewise.config import EngineConfig
    from stagewise.graph.policy import policy_for
    assert policy_for(EngineConfig.from_kwargs(model=str(qwen3_5_dir)), "cpu").backend == "off"
    with pytest.raises(ValueError, match="linear-attention layers .* run eager"):
        policy_for(EngineConfig.from_kwargs(model=str(qwen3_5_dir), **flags), "cpu")


def test_tensor_parallelism_is_refused_in_one_sentence(qwen3_5_dir):
    from stagewise.checkpoint.files import load_hf_config
    from stagewise.model.registry import get_model_class
    from stagewise.parallel import tp
    config = load_hf_config(qwen3_5_dir)
    with pytest.raises(ValueError, match="runs with tp_size 1"):
        tp.check_model(config, get_model_class(config.architectures[0]), 2)


@pytest.mark.slow
def test_llm_batched_chunked_at_pp1_and_pp2_matches_hf_tokens_and_logprobs(qwen3_5_dir, hf_greedy, hf_logits):
    """The engine end to end: three requests batched, prompts cut into 16-token chunks, PP=2 in stage
    processes; greedy tokens and their logprobs as transformers'."""
    from stagewise import LLM, SamplingParams
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    want = hf_greedy(qwen3_5_dir, PROMPTS, 10)
    for pp in (1, 2):
        with LLM(model=str(qwen3_5_dir), pp_size=pp, chunked_prefill_size=16, max_num_seqs=4) as llm:
            out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == want, pp
        for ids, o in zip(PROMPTS, out):
            full = ids + list(o.outputs[0].token_ids)
            ref = torch.log_softmax(hf_logits(qwen3_5_dir, full[:-1]), -1)[len(ids) - 1:]
            entries = o.outputs[0].logprobs
            assert [e.token_id for e in entries] == list(o.outputs[0].token_ids)
            got = [e.logprob for e in entries]
            want_lp = [float(ref[i, t]) for i, t in enumerate(o.outputs[0].token_ids)]
            assert got == pytest.approx(want_lp, abs=1e-3), pp


@pytest.mark.slow
@pytest.mark.parametrize("pp_size", [1, 2])
def test_preempted_requests_restart_from_a_zero_state(qwen3_5_dir, hf_greedy, pp_size):
    """12 KV blocks of 16 tokens (one attention layer) for three requests growing to 116, 57 and 45
    tokens: some are preempted and recompute their prompt and outputs from a zero state; the prefix
    cache is off for this model, so nothing is reused from a block without its state."""
    from stagewise import LLM, SamplingParams
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(model=str(qwen3_5_dir), pp_size=pp_size, kv_cache_memory=12 * 2 * 16 * 2 * 16 * 4) as llm:
        assert not llm.engine.scheduler.blocks.enable_prefix_caching
        out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(qwen3_5_dir, PROMPTS, 40)


@pytest.mark.slow
def test_a_killed_linear_stage_is_replaced_and_its_requests_recomputed(qwen3_5_dir, hf_greedy):
    """PP=2 split after the linear layers: the stage holding the recurrent states is SIGKILLed mid-generate;
    its replacement starts with empty slots and every request is recomputed from its tokens."""
    import os
    import signal
    import threading
    import time

    from stagewise import LLM, SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(model=str(qwen3_5_dir), pp_size=2, pp_layer_partition="3,1", dist_timeout_s=60,
             max_pipeline_restarts=1, pipeline_spares_delay_s=0) as llm:
        llm.engine.step()
        deadline = time.monotonic() + 60
        while llm.stats()["recovery"]["spares_ready"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        target = llm.engine.stats_.num_steps + 6

        def kill():
            end = time.monotonic() + 60
            while llm.engine.stats_.num_steps < target and time.monotonic() < end:
                time.sleep(0.002)
            os.kill(llm.engine.executor.procs[0].pid, signal.SIGKILL)
        thread = threading.Thread(target=kill, daemon=True)
        thread.start()
        out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        thread.join()
        restarts = llm.stats()["recovery"]
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(qwen3_5_dir, PROMPTS, 24)
    assert sum(restarts["rebuilds"].values()) >= 1 and restarts["recovered_requests"] >= 1, restarts


@pytest.mark.parametrize("pp_size,partition", [(1, None), (2, [3, 1])])
def test_qwen3_next_matches_hf(qwen3_next_dir, eager_pipeline, hf_logits, hf_greedy, pp_size, partition):
    """Qwen3-Next: q/k/v/z and b/a projected per key head, MoE MLPs with a shared expert (layer 1 dense)."""
    from stagewise.model.moe import SparseMoE
    pipe = eager_pipeline(qwen3_next_dir, pp_size=pp_size, partition=partition)
    kinds = [type(pipe.stages[-1 if i == 3 else 0].layers[i].mlp) for i in range(4)]
    assert [k is SparseMoE for k in kinds] == [True, False, True, True]
    torch.testing.assert_close(_chunked_logits(pipe, PROMPTS[2], [30]), hf_logits(qwen3_next_dir, PROMPTS[2]),
                               atol=5e-4, rtol=0)
    assert pipe.greedy(PROMPTS[1], 12) == hf_greedy(qwen3_next_dir, PROMPTS[1:2], 12)[0]


@pytest.mark.slow
def test_qwen3_next_llm_at_pp2_matches_hf(qwen3_next_dir, hf_greedy):
    from stagewise import LLM, SamplingParams
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(model=str(qwen3_next_dir), pp_size=2, chunked_prefill_size=16) as llm:
        out = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(qwen3_next_dir, PROMPTS, 10)


def test_speculative_decoding_is_refused_in_one_sentence(qwen3_5_dir):
    from stagewise import LLM
    with pytest.raises(ValueError, match="linear-attention layers"):
        LLM(model=str(qwen3_5_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("pp_size,partition", [(1, None), (2, [3, 1])])
def test_gguf_matches_hf(qwen3_5_dir, tiny_gguf, eager_pipeline, hf_logits, hf_greedy, pp_size, partition):
    """A `qwen35` file as llama.cpp's converter writes it (value heads tiled over the key heads, `-exp(A_log)`,
    `(1 + w)` norms with the 1 added, the conv weight squeezed, a quarter of each head rotated)."""
    from stagewise.checkpoint.files import load_hf_config
    path = tiny_gguf("qwen3_5")
    mine, hf = load_hf_config(path), load_hf_config(qwen3_5_dir)
    assert mine.architectures == hf.architectures and mine.layer_types == hf.layer_types
    assert (mine.linear_num_key_heads, mine.linear_num_value_heads, mine.linear_key_head_dim,
            mine.linear_value_head_dim) == (2, 4, 16, 8) and mine.linear_v_heads_tiled
    pipe = eager_pipeline(path, pp_size=pp_size, partition=partition)
    torch.testing.assert_close(pipe.prefill_logits(PROMPTS[2]), hf_logits(qwen3_5_dir, PROMPTS[2]), atol=ATOL, rtol=0)
    assert pipe.greedy(PROMPTS[1], 12) == hf_greedy(qwen3_5_dir, PROMPTS[1:2], 12)[0]


def test_gguf_value_heads_in_the_files_order_matter(qwen3_5_dir, tiny_gguf, eager_pipeline, hf_logits):
    """Read in transformers' grouped order, the file's tiled value heads give other logits (the flag matters)."""
    from stagewise.model.qwen3_5 import GatedDeltaNet
    pipe = eager_pipeline(tiny_gguf("qwen3_5"))
    for layer in pipe.stages[0].layers:
        if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
            layer.linear_attn.tiled = False
    assert not torch.allclose(pipe.prefill_logits(PROMPTS[1]), hf_logits(qwen3_5_dir, PROMPTS[1]), atol=1e-2)


def test_gguf_q8_0_runs_the_files_values(qwen3_5_dir, tiny_gguf, eager_pipeline, gguf_tools, tmp_path):
    """Q8_0 projections held quantized give what an F32 file of the same (dequantized) values gives;
    the F32 path is the one tested against transformers above."""
    import gguf
    from transformers import AutoConfig
    quant = gguf.GGMLQuantizationType.Q8_0
    tensors = gguf_tools.gguf_tensors(qwen3_5_dir, AutoConfig.from_pretrained(qwen3_5_dir), "qwen35")
    values = {name: gguf.quants.dequantize(gguf.quants.quantize(a, quant), quant)
              if a.ndim == 2 and a.shape[-1] % 32 == 0 else a for name, a in tensors.items()}
    ref = gguf_tools.write_gguf(qwen3_5_dir, tmp_path / "dq.gguf", "F32", tensors=values)
    got = eager_pipeline(tiny_gguf("qwen3_5", "Q8_0"), pp_size=2, partition=[3, 1]).prefill_logits(PROMPTS[2])
    torch.testing.assert_close(got, eager_pipeline(ref).prefill_logits(PROMPTS[2]), atol=1e-4, rtol=0)
