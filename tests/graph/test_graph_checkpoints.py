"""Graph runners on real (tiny, local) HF checkpoints: PP=2 with prefill and decode graphs gives
the same greedy tokens as PP=1 eager and HF transformers; embeddings under graphs equal HF."""
import pytest
import torch
from tape import TapeBackend

from stagewise.checkpoint.facts import read_facts
from stagewise.graph.policy import decide_verdict, resolve_graph_policy
from stagewise.graph.runner import StageGraphRunner
from stagewise.model.attention import AttentionMetadata, ForwardBatch
from stagewise.model.loader import load_model
from stagewise.parallel.partition import stage_infos
from stagewise.parallel.proxy import ProxyTensors

BLOCK_SIZE, NUM_BLOCKS, TABLE = 16, 8, [1, 2, 3, 4]   # block 0: scratch for padded rows


class GraphPipeline:
    """Every stage of a checkpoint in this process, each behind its own StageGraphRunner."""

    def __init__(self, model_dir, pp_size, emulation):
        num_layers = read_facts(model_dir).num_layers
        # a short explicit list keeps tape capture quick; 47 tokens -> 48, 21 -> 24
        self.policy = resolve_graph_policy("breakable", buckets=[8, 24, 48], pp_size=pp_size, device_type="cpu",
                                           decode_graph=True, decode_graph_max_bs=4)
        self.stages = []
        for info in stage_infos(num_layers, pp_size):
            model = load_model(model_dir, info, torch.float32)
            hkv, d = model.kv_cache_spec()
            caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, hkv, d) if info.owns(i) else None
                      for i in range(num_layers)]
            emulator = TapeBackend if emulation == "tape" else None
            runner = StageGraphRunner(model, info, self.policy, ForwardBatch(None, caches), torch.float32, "cpu",
                                      emulator=emulator, max_seq_len=len(TABLE) * BLOCK_SIZE)
            runner.capture()
            self.stages.append((model, runner))

    def step(self, ids, positions, meta, decode_only, input_embeds=None):
        verdict = decide_verdict(self.policy, meta.num_tokens, decode_only, len(meta.query_lens))
        out = None
        for model, runner in self.stages:
            first = model.stage.is_first
            out = runner.forward(verdict, ids if first and input_embeds is None else None, positions, meta,
                                 input_embeds=input_embeds if first else None, proxy=out)
            if isinstance(out, ProxyTensors):
                out = out.clone()        # what the pipeline's send does: graph memory is reused
        return verdict, self.stages[-1][0].compute_logits(out)

    def greedy(self, ids, max_new_tokens):
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [TABLE], BLOCK_SIZE)
        verdicts, (verdict, logits) = [], self.step(torch.tensor(ids), torch.arange(len(ids)), meta, False)
        out = [int(logits[-1].argmax())]
        verdicts.append(verdict)
        for i in range(max_new_tokens - 1):
            seq_len = len(ids) + i + 1
            meta = AttentionMetadata.build([1], [seq_len], [TABLE], BLOCK_SIZE)
            verdict, logits = self.step(torch.tensor(out[-1:]), torch.tensor([seq_len - 1]), meta, True)
            verdicts.append(verdict)
            out.append(int(logits[-1].argmax()))
        return out, verdicts


def prompt(n=47, seed=0):
    return torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family,emulation", [("llama", "tape"), ("gpt2", "tape"), ("llama", "rerun")])
def test_pp2_graphs_match_pp1_eager_and_hf(family, emulation, request, eager_pipeline, hf_greedy):
    model_dir = request.getfixturevalue(f"{family}_dir")
    ids = prompt()
    pipe = GraphPipeline(model_dir, 2, emulation)
    tokens, verdicts = pipe.greedy(ids, 5)
    assert verdicts[0].bucket == 48 and all(v.kind == "decode" and v.bucket == 1 for v in verdicts[1:])
    assert tokens == eager_pipeline(model_dir, 1).greedy(ids, 5)
    assert tokens == hf_greedy(model_dir, [ids], 5)[0]
    for _, runner in pipe.stages:
        assert runner.stats()["replays"] == {48: 1} and runner.stats("decode")["replays"] == {1: 4}


def test_input_embeds_under_graphs_equal_eager_and_hf(llama_dir, eager_pipeline, hf_logits):
    ids = prompt(21, seed=1)
    pipe = GraphPipeline(llama_dir, 2, "tape")
    embed = pipe.stages[0][0].embed_tokens
    with torch.no_grad():
        embeds = embed(torch.tensor(ids)) + 0.05 * torch.randn(len(ids), embed.weight.shape[1],
                                                              generator=torch.Generator().manual_seed(2))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [TABLE], BLOCK_SIZE)
    verdict, logits = pipe.step(None, torch.arange(len(ids)), meta, False, input_embeds=embeds)
    assert verdict.bucket == 24
    torch.testing.assert_close(logits, eager_pipeline(llama_dir, 1).prefill_logits(ids, embeds), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, hf_logits(llama_dir, ids, inputs_embeds=embeds), rtol=1e-4, atol=1e-4)
