"""Worker: one pipeline stage on one device. Holds the stage's model, KV cache, graph runner
and per-request cache; turns a StepPlan (+ the previous stage's proxy) into this stage's output.

The per-request cache is kept in step with the driver by the plan's deltas only. A plan that
fails here is caught here, in one place for every executor: the deltas still apply, and the
stage answers a failure (`StepResult.error` on the last stage, `PlanFailed` before it) so the
driver fails just that plan's requests.
"""
from __future__ import annotations

import logging
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..checkpoint.pooling import resolve_pooling
from ..config import EngineConfig
from ..model.attention import AttentionMetadata
from ..parallel.partition import StageInfo
from ..parallel.proxy import ProxyTensors
from ..plan import PlanFailed, StepPlan, StepResult
from ..request import SamplingParams
from .kernels import gemm_kernels
from .sampler import Sampler, prompt_logprobs
from .setup import build_stage
from .speculative import accept, draft_views
from .team import StepTeam

log = logging.getLogger("stagewise.worker")


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    input_embeds: Any = None
    pooled: Any = None          # embedding requests, mean pooling: the float32 sum of the rows so far
    state_slot: int | None = None   # models with recurrent layers: this request's slot (kvcache/state.py)

    @property
    def samples(self) -> bool:
        """Whether this request's final prompt row is sampled (an embedding request's is pooled)."""
        return not self.params.embed


class Worker:
    def __init__(self, config: EngineConfig, model_dir: str, stage: StageInfo, eos_token_ids: tuple[int, ...] = (),
                 tp_group: Any = None):
        """`tp_group`: this rank's tensor-parallel group (parallel/groups.py); None: the whole stage here."""
        self.config, self.stage, self.eos_token_ids = config, stage, tuple(eos_token_ids)
        parts = build_stage(config, model_dir, stage, tp_group)
        self.model: Any = parts.model     # the model contract (README): duck-typed
        self.runner, self.memory_plan = parts.runner, parts.memory_plan
        self.device, self.batch = parts.device, parts.batch
        self.cpu_pool = parts.cpu_pool
        self.states = parts.states       # recurrent-state slots (linear-attention layers), or None
        self.team: StepTeam | None = None           # CPU: the threads each step uses (runtime/team.py)
        if self.device.type == "cpu":
            self.team = StepTeam(torch.get_num_threads(), self.runner.decode_threads, torch.set_num_threads)
        self.dtype = next(self.model.parameters()).dtype
        self.sampler = Sampler(config.load.seed + 1, self.eos_token_ids)
        self.reqs: dict[str, _ReqState] = {}
        self.busy_s = 0.0
        # embedding requests (SamplingParams.embed) pool the last stage's normed hidden states
        self.pooling = resolve_pooling(config.load.pooling, model_dir) if stage.is_last else None

    @property
    def comm_s(self) -> float:
        """Seconds this rank spent in its tensor-parallel collectives (0 without TP)."""
        clock = self.model.__dict__.get("tp_clock")
        return clock.seconds if clock is not None else 0.0

    @property
    def num_blocks(self) -> int:
        return self.memory_plan.num_blocks

    def execute(self, plan: StepPlan, proxy: ProxyTensors | None) -> ProxyTensors | StepResult | PlanFailed:
        """Run this stage's share of `plan`. A non-last stage returns T-row proxy views of
        graph memory: send or copy them before the next `execute`."""
        t0 = time.perf_counter()
        self.apply_deltas(plan)
        result: ProxyTensors | StepResult | PlanFailed
        try:
            with self.runner.step_scope(), self._threads(plan.verdict, plan.num_tokens):
                result = self._run(plan, proxy)
        except Exception as exc:  # noqa: BLE001 (this plan fails; the engine and the other plans go on)
            log.error("plan %d failed on stage %d:\n%s", plan.plan_id, self.stage.rank, traceback.format_exc())
            result = self.failed(plan, f"stage {self.stage.rank} failed: {type(exc).__name__}: {exc}")
        self.busy_s += time.perf_counter() - t0
        return result

    @contextmanager
    def _threads(self, verdict: Any, rows: int) -> Iterator[None]:
        """The step's team (one thread for the decode steps of a small model: runtime/team.py), kept awake
        by the stage's keepers while it runs (a one-thread step opens no parallel region)."""
        with self.team.scope(verdict, rows) if self.team is not None else nullcontext(0) as threads:
            awake = self.cpu_pool is not None and threads != 1
            with self.cpu_pool.step() if awake else nullcontext():
                yield

    def skip(self, plan: StepPlan, why: str) -> StepResult | PlanFailed:
        """A plan that failed upstream: keep the per-request cache in step, pass the failure on."""
        self.apply_deltas(plan)
        return self.failed(plan, why)

    def failed(self, plan: StepPlan, why: str) -> StepResult | PlanFailed:
        return StepResult(plan.plan_id, error=why) if self.stage.is_last else PlanFailed(why)

    def _run(self, plan: StepPlan, proxy: ProxyTensors | None) -> ProxyTensors | StepResult:
        with torch.inference_mode():
            ids, positions, meta, embeds, sample_rows = self._prepare(plan)
            self.batch.meta = meta
            eager = not self.runner.will_replay(plan.verdict)      # captured graphs keep their kernels
            with gemm_kernels(meta.num_tokens if eager else 0, self.dtype, self.device):
                out = self.runner.forward(plan.verdict, ids, positions, meta, input_embeds=embeds, proxy=proxy)
            if not self.stage.is_last:
                return out
            with gemm_kernels(len(sample_rows), self.dtype, self.device):
                result = self._sample(plan, out, sample_rows)
            self._prompt_logprobs(plan, out, result)
            self._pool(plan, out, result)
            return result

    def apply_deltas(self, plan: StepPlan) -> None:
        if plan.loras is not None:
            self._sync_loras(plan.loras)
        if plan.zero_block_ids:
            blocks = torch.tensor(plan.zero_block_ids, dtype=torch.long, device=self.device)
            for cache in self.batch.kv_caches:
                if cache is not None:
                    cache.index_fill_(1, blocks, 0)
        for rid in plan.finished_req_ids:
            self._forget(rid)
        for r in plan.new_reqs:
            self._forget(r.request_id)      # a request sent whole again restarts (its old slot goes back)
            self.reqs[r.request_id] = _ReqState(list(r.token_ids), r.num_prompt_tokens, r.params,
                                                list(r.block_ids), r.input_embeds)
            if self.states is not None:
                self.reqs[r.request_id].state_slot = self.states.allocate()
        for c in plan.cached_reqs:
            st = self.reqs[c.request_id]
            if c.num_kept_blocks is not None:
                del st.block_ids[c.num_kept_blocks:]
            st.token_ids.extend(c.new_token_ids)
            st.block_ids.extend(c.new_block_ids)

    def _sync_loras(self, table: dict[str, str]) -> None:
        """Runtime LoRA loads and unloads. The driver read each adapter before it sent the table; one this
        stage cannot read (its node lacks the path) is logged, and its requests fail here (`adapter_of`)."""
        lora = self.model.__dict__.get("lora")
        if lora is not None:
            lora.sync(table, lambda name, exc: log.error("stage %d could not load the LoRA adapter %r: %s",
                                                         self.stage.rank, name, exc))

    def _forget(self, rid: str) -> None:
        st = self.reqs.pop(rid, None)
        if st is not None and st.state_slot is not None and self.states is not None:
            self.states.release(st.state_slot)

    def _slot(self, rid: str) -> int:
        slot = self.reqs[rid].state_slot
        assert slot is not None, "every request of a stage with a state pool has a slot"
        return slot

    def _prepare(self, plan: StepPlan):
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        embed_parts: list[tuple[int, torch.Tensor]] = []   # (row offset, [n, H]) from embedding prompts
        lora = self.model.__dict__.get("lora")     # model/lora.py's LoraSet, with --lora-modules
        row_adapters: list[int] = []
        for seq in plan.seqs:
            st = self.reqs[seq.request_id]
            end = seq.start + seq.num_tokens
            known_end = end - len(seq.draft_token_ids)
            if known_end > len(st.token_ids):
                raise RuntimeError(f"Plan {plan.plan_id} asks for tokens of {seq.request_id} this stage lacks.")
            if st.input_embeds is not None and seq.start < st.num_prompt_tokens:
                embed_parts.append((len(ids), st.input_embeds[seq.start:min(end, st.num_prompt_tokens)]))
            ids.extend(st.token_ids[seq.start:known_end])
            ids.extend(seq.draft_token_ids)
            if lora is not None:
                row_adapters.extend([lora.adapter_of(st.params.lora)] * seq.num_tokens)
            positions.extend(range(seq.start, end))
            query_lens.append(seq.num_tokens)
            seq_lens.append(end)
            tables.append(st.block_ids)
            if seq.sample and st.samples:      # the last row, and one more per draft (verified rows)
                sample_rows.extend(range(len(ids) - 1 - len(seq.draft_token_ids), len(ids)))
        dev = self.device
        if lora is not None:
            lora.set_rows(row_adapters, dev)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.config.cache.block_size, dev)
        if self.states is not None:
            meta.state_slots = [self._slot(seq.request_id) for seq in plan.seqs]
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev) if self.stage.is_first else None
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        embeds = self._embeds(ids_t, embed_parts) if embed_parts and ids_t is not None else None
        return (None if embeds is not None else ids_t), pos_t, meta, embeds, sample_rows

    def _embeds(self, ids: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Token embeddings for the whole step with the given prompt embeddings written over their rows."""
        embeds = self.model.embed_tokens(ids).clone()  # [T, H]
        for offset, rows in parts:
            embeds[offset:offset + rows.shape[0]] = rows.to(embeds.device, embeds.dtype)
        return embeds

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, result: StepResult) -> None:
        """Logprobs of the prompt tokens this step's rows predict, for requests that ask for them
        (only those pay for the extra LM-head rows)."""
        row = 0
        for seq in plan.seqs:
            st = self.reqs[seq.request_id]
            k, last = st.params.prompt_logprobs, min(seq.start + seq.num_tokens, st.num_prompt_tokens - 1)
            if k is not None and seq.start < last:
                targets = st.token_ids[seq.start + 1:last + 1]
                entries = prompt_logprobs(self.model.compute_logits, hidden[row:row + len(targets)], targets, k)
                result.prompt_logprobs[seq.request_id] = (seq.start + 1, entries)
            row += seq.num_tokens

    def _pool(self, plan: StepPlan, hidden: torch.Tensor, result: StepResult) -> None:
        """Embedding requests: pool their rows of the (final-normed) hidden states; a prompt's final
        chunk answers its L2-normalised vector. Mean pooling sums over chunks in float32."""
        row = 0
        for seq in plan.seqs:
            st = self.reqs[seq.request_id]
            rows = hidden[row:row + seq.num_tokens]
            row += seq.num_tokens
            if st.samples:
                continue
            if self.pooling == "mean":
                part = rows.float().sum(0)
                st.pooled = part if st.pooled is None else st.pooled + part
            if seq.sample:
                vec = st.pooled / st.num_prompt_tokens if self.pooling == "mean" else rows[-1].float()
                result.embeddings[seq.request_id] = torch.nn.functional.normalize(vec, dim=0).cpu().tolist()

    def _sample(self, plan: StepPlan, hidden: torch.Tensor, sample_rows: list[int]) -> StepResult:
        result = StepResult(plan.plan_id)
        if not sample_rows:
            return result
        rows = hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows]   # decode: every row
        logits = self.model.compute_logits(rows).float().cpu()  # [R, V]
        seqs = [s for s in plan.seqs if s.sample and self.reqs[s.request_id].samples]
        if any(s.draft_token_ids for s in seqs):
            return self._verify(result, logits, seqs, plan)
        draws = self.sampler.sample(logits, [self.reqs[s.request_id] for s in seqs], _mask_rows(plan, seqs))
        for seq, draw in zip(seqs, draws):
            if draw.error is not None:
                result.failed[seq.request_id] = draw.error
                continue
            assert draw.token is not None, "a draw without an error has a token"
            result.sampled[seq.request_id] = draw.token
            if draw.logprob is not None:
                result.logprobs[seq.request_id] = draw.logprob
        return result

    def _verify(self, result: StepResult, logits: torch.Tensor, seqs: list, plan: StepPlan) -> StepResult:
        """A step with drafts: every verified row sampled as its own position, then accepted
        (runtime/speculative.py). Constrained requests get no drafts: their one row takes the mask."""
        views = [draft_views(self.reqs[s.request_id], s.draft_token_ids) for s in seqs]
        mask = _mask_rows(plan, seqs)
        if mask is not None:
            starts = [0]
            for rows in views:
                starts.append(starts[-1] + len(rows))
            mask = ([starts[i] for i in mask[0]], mask[1])
        draws = self.sampler.sample(logits, [v for rows in views for v in rows], mask)
        offset = 0
        for seq, rows in zip(seqs, views):
            verified = accept(seq.draft_token_ids, draws[offset:offset + len(rows)])
            offset += len(rows)
            rid = seq.request_id
            if verified.error is not None:
                result.failed[rid] = verified.error
                continue
            assert verified.token is not None, "a verified row without an error has a token"
            result.sampled[rid] = verified.token
            if verified.accepted:
                result.accepted[rid] = verified.accepted
            if verified.logprob is not None:
                result.logprobs[rid] = verified.logprob
                if verified.accepted:
                    result.accepted_logprobs[rid] = verified.accepted_logprobs
        return result


def _mask_rows(plan: StepPlan, seqs: list) -> tuple[list[int], torch.Tensor] | None:
    """The plan's token bitmask as (sampling-row indices, bits), or None when no row is constrained."""
    mask = plan.token_bitmask
    if mask is None:
        return None
    row_of = {s.request_id: i for i, s in enumerate(seqs)}
    return [row_of[rid] for rid in mask.request_ids], mask.bits
