"""Balanced pipelines without processes: the cost partition (solver and per-family cost models),
the dynamic chunk sizer and its fit, balanced micro-batches in the scheduler (in-flight invariant,
step order), the balance statistics and their /metrics families, and `stagewise plan`'s lines."""
import math
import random
from collections import deque

import pytest
import transformers as tf

from stagewise.checkpoint.facts import facts_of_config, read_facts
from stagewise.config import EngineConfig
from stagewise.engine.balance import (
    ChunkCosts,
    DecodeBalancer,
    DynamicChunkSizer,
    FixedChunks,
    LinkDepth,
    fit_chunk_costs,
)
from stagewise.engine.scheduler import Scheduler
from stagewise.engine.stats import EngineStats
from stagewise.kvcache.block_manager import BlockManager
from stagewise.model.llama import LlamaForCausalLM
from stagewise.model.loader import _architecture
from stagewise.model.registry import get_model_class
from stagewise.parallel.partition import balanced_partition, partition_layers, stage_costs
from stagewise.plan import StepResult
from stagewise.planning.stage_cost import cost_model, resolve_partition
from stagewise.request import FinishReason, Request, SamplingParams

FAMILIES = ("llama", "llama_tied", "mistral", "qwen2", "qwen3", "gpt2")


# the solver
def test_balanced_partition_minimises_the_slowest_stage():
    assert balanced_partition([1.0] * 8, 2, last_extra=4.0) == (6, 2)
    assert balanced_partition([1.0] * 8, 2) == (4, 4)
    sizes = balanced_partition([1.0] * 10, 4)
    assert sum(sizes) == 10 and max(stage_costs(sizes, [1.0] * 10)) == 3
    assert balanced_partition([1.0] * 8, 2, rates=[1.0, 0.5]) in ((5, 3), (6, 2))
    assert max(c / r for c, r in zip(stage_costs(balanced_partition([1.0] * 9, 2, rates=[1.0, 0.5]), [1.0] * 9),
                                      [1.0, 0.5])) == 6
    # exhaustive check against every split on random costs
    rng = random.Random(3)
    for _ in range(20):
        costs = [rng.uniform(0.5, 2.0) for _ in range(7)]
        head = rng.uniform(0, 5)
        best = min(max(stage_costs((a, 7 - a), costs, 0.0, head)) for a in range(1, 7))
        got = balanced_partition(costs, 2, last_extra=head)
        assert max(stage_costs(got, costs, 0.0, head)) == pytest.approx(best)
    with pytest.raises(ValueError, match="between 1 and 3 stages"):
        balanced_partition([1.0] * 3, 4)


def test_even_and_explicit_rules_are_unchanged():
    assert partition_layers(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert partition_layers(10, 4, "even") == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert partition_layers(10, 4, (3, 3, 2, 2)) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="resolved"):
        partition_layers(10, 4, "auto")


# the cost model per family
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_partitions_are_valid_for_every_family(tiny_model_dirs, family):
    model_dir = str(tiny_model_dirs[family])
    facts = read_facts(model_dir)
    n = facts.num_layers
    for pp in range(2, n + 1):
        sizes = resolve_partition(EngineConfig.from_kwargs(model=model_dir, pp_size=pp), facts)
        assert len(sizes) == pp and all(s >= 1 for s in sizes) and sum(sizes) == n
    explicit = tuple([1] * (n - 1) + [1]) if n == 2 else (n - 1, 1)
    given = EngineConfig.from_kwargs(model=model_dir, pp_size=2, pp_layer_partition=explicit)
    assert resolve_partition(given, facts) == explicit


def _heavy_head(family: str, tied: bool):
    common = dict(vocab_size=32000, num_hidden_layers=8, max_position_embeddings=512, tie_word_embeddings=tied)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=8, n_head=4, n_inner=128, n_positions=512, vocab_size=32000,
                             tie_word_embeddings=tied, architectures=["GPT2LMHeadModel"])
    return tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          architectures=["LlamaForCausalLM"], **common)


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("gpt2", True), ("gpt2", False)])
def test_a_heavy_head_gets_fewer_layers_on_the_last_stage(family, tied):
    hf = _heavy_head(family, tied)
    cls = get_model_class(_architecture(hf, "heavy"))
    model = cost_model(facts_of_config(hf), cls, __import__("torch").float32)
    sizes = model.partition(2)
    assert sizes[-1] < sizes[0], sizes
    even = (4, 4)
    assert max(model.stage_costs(sizes)) < max(model.stage_costs(even))
    # the head is V x H multiply-adds per sampled row, whether tied or not
    assert model.last_extra >= 32000 * 64
    prefill = cost_model(facts_of_config(hf), cls, __import__("torch").float32, mix="prefill", chunk_len=512)
    assert prefill.last_extra < model.last_extra / 100        # one sampled row per chunk
    assert sum(prefill.partition(2)) == 8


def test_cost_model_counts_layer_weights():
    hf = _heavy_head("llama", False)
    model = cost_model(facts_of_config(hf), LlamaForCausalLM, __import__("torch").float32)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64      # q, o, k, v, mlp, two norms
    assert model.layer_costs[0] == pytest.approx(per_layer + 2 * 256 * 64)   # + attention over 256 (512 / 2)
    costs = model.stage_costs((6, 2))
    assert model.shares((6, 2)) == pytest.approx([c / sum(costs) for c in costs])


def test_node_rates_shift_layers_to_the_fast_node(llama_dir):
    cfg = dict(model=str(llama_dir), pp_size=2, nnodes=2, master_port=29999)
    even_speed = resolve_partition(EngineConfig.from_kwargs(**cfg))
    slow_second = resolve_partition(EngineConfig.from_kwargs(**cfg, pp_node_rates="1,0.25"))
    assert slow_second[1] <= even_speed[1] and slow_second[0] > slow_second[1]
    with pytest.raises(ValueError, match="pp_node_rates needs 2 positive"):
        EngineConfig.from_kwargs(**cfg, pp_node_rates="1,0")


# dynamic chunk sizing
def test_fit_recovers_the_chunk_cost_model():
    truth = ChunkCosts(2e-3, 5e-6, 4e-9)
    samples = [(s, x, truth.seconds(s, x)) for x in (256, 512) for s in range(0, 2048, x)]
    fit = fit_chunk_costs(samples)
    assert fit.c1 == pytest.approx(truth.c1, rel=1e-6) and fit.c2 == pytest.approx(truth.c2, rel=1e-6)
    noisy = fit_chunk_costs([(s, x, max(0.0, truth.seconds(s, x) - 3e-9 * x * s)) for s, x, _ in samples])
    assert noisy.c2 >= 0 and noisy.c1 >= 0                 # a negative term is refitted away


def test_dynamic_chunks_shrink_stay_in_budget_and_cost_about_the_first():
    costs = ChunkCosts(1e-3, 5e-6, 4e-9)
    sizer = DynamicChunkSizer(costs, base=512)
    start, lens = 0, []
    while start < 8192:
        n = sizer.chunk_len(start, 8192 - start, 512)
        assert 1 <= n <= 512
        lens.append(n)
        start += n
    assert start == 8192 and lens[0] == 512 and lens[-2] < lens[0]
    assert all(a >= b for a, b in zip(lens[:-1], lens[1:-1]))       # non-increasing (the last is a remainder)
    first = costs.seconds(0, 512)
    pos = 0
    for n in lens[:-1]:
        assert costs.seconds(pos, n) <= first * 1.0001 or n == sizer.min_len
        assert n % sizer.align == 0
        pos += n
    assert sizer.chunk_len(4096, 8192, 100) <= 100                   # a smaller budget always wins
    assert FixedChunks().chunk_len(4096, 8192, 512) == 512
    assert "dynamic chunks" in sizer.describe()


# balanced micro-batches
def _req(rid, n_prompt, max_tokens):
    return Request(rid, list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0))


def _length_rule(req):
    return FinishReason.LENGTH if len(req.output_token_ids) >= req.params.max_tokens else None


def _drive(depth: int, balance: bool, seed: int, chunker=None):
    """Random arrivals and pipeline delays; asserts the in-flight invariant and step order after every
    schedule. Returns the preemptions and each request's booked (start, n) rows."""
    rng = random.Random(seed)
    s = Scheduler(BlockManager(40, 4), max_num_seqs=16, token_budget=24, stop_rule=_length_rule)
    s.balancer = DecodeBalancer(depth if balance else 1)
    if chunker is not None:
        s.chunker = chunker
    pending = [_req(f"r{i}", rng.randint(1, 60), rng.randint(1, 12)) for i in range(24)]
    inflight: deque = deque()
    rows: dict[str, list[tuple[int, int]]] = {}
    while pending or s.has_unfinished() or inflight:
        for _ in range(rng.randint(0, 3)):
            if pending:
                s.add(pending.pop(0))
        while len(inflight) < depth and (plan := s.schedule()) is not None:
            assert plan.num_tokens <= s.token_budget
            in_flight_ids = [q.request_id for p in inflight for q in p.seqs]
            for q in plan.seqs:
                booked = rows.setdefault(q.request_id, [])
                # step order: the next rows, or a recompute after preemption (never while it flies)
                assert not booked or booked[-1][0] + booked[-1][1] == q.start or (
                    q.start < booked[-1][0] + booked[-1][1] and q.request_id not in in_flight_ids)
                if q.request_id in in_flight_ids:     # only a non-final prefill chunk may already fly
                    assert not any(o.sample for p in inflight for o in p.seqs if o.request_id == q.request_id)
                booked.append((q.start, q.num_tokens))
            inflight.append(plan)
        if inflight and (rng.random() < 0.7 or len(inflight) == depth):
            plan = inflight.popleft()
            s.update(plan, StepResult(plan.plan_id, sampled={q.request_id: 9 for q in plan.seqs if q.sample}))
    assert not s.records
    return s.num_preemptions, rows


@pytest.mark.parametrize("depth", [2, 3])
def test_balanced_micro_batches_keep_step_order_and_never_double_book(depth):
    preemptions = 0
    for seed in range(6):
        preemptions += _drive(depth, True, seed)[0]
        _drive(depth, True, seed, chunker=DynamicChunkSizer(ChunkCosts(0.0, 1e-6, 1e-7), base=24, align=4))
    assert preemptions > 0            # the small cache makes the runs recompute too


def test_a_burst_of_decodes_splits_over_the_plans_in_flight():
    for balance, expected in ((True, [4, 4]), (False, [8, 0])):
        s = Scheduler(BlockManager(256, 4), max_num_seqs=16, token_budget=64)
        s.balancer = DecodeBalancer(2 if balance else 1)
        for i in range(8):
            s.add(_req(f"r{i}", 4, 20))
        plan = s.schedule()                       # all 8 prompts in one plan
        assert plan is not None
        s.update(plan, StepResult(plan.plan_id, sampled={q.request_id: 9 for q in plan.seqs}))
        first, second = s.schedule(), s.schedule()
        assert first is not None
        got = [len(first.seqs), len(second.seqs) if second is not None else 0]
        assert got == expected
        ids = {q.request_id for q in first.seqs} & ({q.request_id for q in second.seqs} if second else set())
        assert not ids


def test_the_benchmark_lever_turns_balancing_off(llama_dir, monkeypatch):
    from stagewise import LLM
    monkeypatch.delenv("STAGEWISE_BALANCE_MICRO_BATCHES", raising=False)
    for value, depth in ((None, 2), ("0", 1)):
        if value is not None:
            monkeypatch.setenv("STAGEWISE_BALANCE_MICRO_BATCHES", value)
        with LLM(model=str(llama_dir), pp_depth=2) as llm:
            assert llm.engine.scheduler.balancer.depth == depth


def test_balanced_decodes_do_not_starve_prefills():
    s = Scheduler(BlockManager(256, 4), max_num_seqs=16, token_budget=16)
    s.balancer = DecodeBalancer(2)
    for i in range(4):
        s.add(_req(f"d{i}", 2, 50))
    plan = s.schedule()
    s.update(plan, StepResult(plan.plan_id, sampled={q.request_id: 9 for q in plan.seqs}))
    s.add(_req("long", 40, 2))
    plan = s.schedule()
    assert plan is not None
    assert sum(1 for q in plan.seqs if q.num_tokens == 1) == 2
    assert any(q.request_id == "long" and q.num_tokens == 14 for q in plan.seqs)


# statistics and metrics
class _Policy:
    backend, buckets, decode_backend, decode_buckets = "off", [], "off", []


def test_balance_stats_and_metric_families():
    from stagewise.server.metrics import _balance_families
    stats = EngineStats(_Policy(), predicted_shares=[0.5, 0.5], busy_base=[1.0, 1.0])
    stats.pipeline_started()
    stats.active_since -= 10.0                    # 10 s with plans in flight
    stats.pipeline_drained()
    stats.record_result(StepResult(0, stage_busy_s=[9.0, 7.0]))    # 8 s and 6 s since the base
    b = stats.balance()
    assert b["stage_bubble_fraction"] == pytest.approx([0.2, 0.4], abs=1e-3)
    assert b["stage_measured_share"] == pytest.approx([8 / 14, 6 / 14])
    assert b["predicted_stage_busy_s"] == pytest.approx([7.0, 7.0])
    families = {f.name: f for f in _balance_families(b, "m")}
    assert [s.value for s in families["stagewise_stage_bubble_fraction"].samples] == pytest.approx([0.2, 0.4], abs=1e-3)
    assert "stagewise_stage_predicted_share" in families and "stagewise_pipeline_active_seconds" in families


def test_plan_prints_the_partition_and_the_even_split(tmp_path, tiny_tokenizer_dir, capsys):
    from stagewise.cli import main
    hf = _heavy_head("llama", False)
    hf.vocab_size = 4096
    model = tf.LlamaForCausalLM(hf)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((tiny_tokenizer_dir / name).read_bytes())
    assert main(["plan", "--model", str(tmp_path), "--pp-size", "2", "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("partition: auto"))
    sizes = tuple(int(v) for v in line.split(": ")[2].split(" ")[0].split(","))
    assert sizes[0] > sizes[1] and "even split for comparison: 4,4" in out
    shares = [float(v.strip("%")) for v in line.split("stage ")[1].split(",")[0].split(" / ")]
    assert math.isclose(sum(shares), 100, abs_tol=2)
    assert main(["plan", "--model", str(tmp_path), "--pp-size", "2", "--pp-layer-partition", "3,5",
                 "--kv-cache-memory", "64MiB"]) == 0
    assert "partition: explicit: 3,5" in capsys.readouterr().out


# --- LinkDepth: plans in flight grown while the busiest stage waits on links ------------------

class Pipe:
    """A pipeline of `stages` as a LinkDepth sees it: plans sent and collected one after another,
    each costing every stage `step` seconds of compute and `link` seconds of waiting on top, with
    one more step of queueing per plan in flight beyond the stage count."""

    def __init__(self, ctl: LinkDepth, stages: int = 2):
        self.ctl, self.stages, self.busy, self.now, self.ids = ctl, stages, [0.0] * stages, 0.0, 0
        self.active = 0.0

    def plans(self, n: int, step: float, link: float, fillable: int = 64) -> int:
        for _ in range(n):
            round_trip = self.stages * step + link + (self.ctl.depth - self.stages) * step
            self.ctl.sent(self.ids, self.now)
            self.now += round_trip
            self.busy = [b + step for b in self.busy]
            self.active += round_trip / self.ctl.depth     # plans overlap: each adds its share of the wall time
            depth = self.ctl.observe(self.ids, self.now, self.busy, self.active, fillable)
            self.ids += 1
        return depth


def test_link_depth_grows_over_a_slow_link_and_stops_at_its_limit():
    pipe = Pipe(LinkDepth(2, 5, window=4))
    assert pipe.plans(5, step=0.02, link=0.04) == 3        # 40 ms of link per round trip > a 20 ms step
    assert pipe.plans(4, step=0.02, link=0.04) == 4
    assert pipe.plans(40, step=0.02, link=0.04) == 5       # the limit
    assert pipe.plans(40, step=0.02, link=0.04) == 5


def test_link_depth_keeps_plans_whole_on_one_machine_and_without_work_for_more():
    assert Pipe(LinkDepth(2, 8, window=4)).plans(40, step=0.02, link=0.001) == 2   # no link to hide
    short = Pipe(LinkDepth(2, 8, window=4))
    assert short.plans(40, step=0.02, link=0.04, fillable=2) == 2     # nothing to fill a third plan with
    assert short.plans(8, step=0.02, link=0.04, fillable=3) == 3


def test_link_depth_starts_over_on_a_pipeline_of_another_size():
    ctl = LinkDepth(2, 8, window=4)
    Pipe(ctl).plans(3, step=0.02, link=0.04)
    rebuilt = Pipe(ctl, stages=3)
    rebuilt.ids = 100
    assert rebuilt.plans(4, step=0.02, link=0.04) == 2      # its first plan only sets the baseline
    assert rebuilt.plans(1, step=0.02, link=0.04) == 3
