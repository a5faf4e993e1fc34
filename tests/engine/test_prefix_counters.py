"""Prefix-cache counters: a preempted request looks up its outputs too, and they count as
queries as well as hits, so hits never exceed queries (the exported counters stay a ratio <= 1)."""
from __future__ import annotations

from stagewise.kvcache.block_manager import BlockManager
from stagewise.request import Request, SamplingParams


def test_hits_never_exceed_queries_after_a_preemption():
    blocks = BlockManager(num_blocks=32, block_size=4)
    req = Request("a", list(range(8)), SamplingParams(max_tokens=64))
    assert blocks.match_prefix(req) == 0
    req.output_token_ids += list(range(100, 124))         # 24 outputs: 32 tokens, 8 blocks
    assert blocks.allocate(req, req.num_tokens) is not None
    blocks.register_full_blocks(req, req.num_tokens)
    blocks.free_request(req)                               # preempted: recomputed from scratch
    assert blocks.match_prefix(req) == 28                  # every full block but the last token's
    assert blocks.num_hit_tokens == 28 and blocks.num_queried_tokens == 8 + 32
    assert blocks.num_hit_tokens <= blocks.num_queried_tokens and blocks.prefix_hit_rate <= 1.0
