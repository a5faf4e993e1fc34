"""Engine: the driver. Owns tokenizer, scheduler and executor; `step()` is the spine:
schedule → submit (up to `depth` plans in flight) → collect the oldest → apply. Request state
changes only through the scheduler (`add`, `update`, `abort`, `fail`): every request ends there;
a constrained one waits there until its grammar is compiled (an admission rule). The engine only
drives: it starts the first pipeline, and its `PipelineSupervisor` (recovery/) rebuilds a lost
pipeline before a step and decides what a failed submit or collect costs. `add_request` and `abort` may be
called from other threads: they only validate and post to an inbox that `step()` drains. Callers
outside `engine/` use this class's surface only (`step`, `fault`, `kv_capacity_tokens`, `stats`).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Iterator, NoReturn

from ..checkpoint.layer_kinds import recurrent_layers
from ..config import EngineConfig
from ..errors import EngineDeadError
from ..executor import Executor
from ..grammar.limits import GrammarLimits
from ..grammar.matchers import StructuredOutputManager
from ..graph.policy import decide_verdict, policy_for
from ..kvcache.block_manager import BlockManager
from ..plan import StepPlan, StepResult
from ..planning.memory import disk_tier_on, format_memory_table
from ..planning.resolved import resolve_startup
from ..planning.stage_cost import predicted_shares
from ..recovery.supervisor import PipelineSupervisor, Unrecoverable, start_pipeline
from ..request import FinishReason, Request, RequestOutput, SamplingParams
from ..runtime.sampler import NO_TOKEN_LEFT
from .balance import LinkDepth
from .inputs import Tokenizer, make_request
from .loras import LoraTable
from .outputs import StepOutputs, finish_check, finish_text, make_output, mark_request_faults
from .profile import balance_scheduler
from .scheduler import Scheduler
from .speculative import make_proposer
from .stats import EngineStats

log = logging.getLogger("stagewise.engine")


def _hybrid_rules(config: EngineConfig, hf_config) -> EngineConfig:
    """A model with recurrent (linear-attention) layers: prefix caching off, since a cached prefix's
    KV blocks would need the recurrent state at the same position, which is not saved per block
    (a restarted prefill recomputes it); speculative decoding refused, since rejected drafts would
    have advanced the state."""
    if not recurrent_layers(hf_config):
        return config
    if config.scheduler.speculative_config is not None:
        raise ValueError("Speculative decoding is not supported for models with linear-attention layers (their "
                         "recurrent state cannot take back rejected drafts); drop speculative_config.")
    if config.cache.enable_prefix_caching:
        log.info("prefix caching: off (this model's linear-attention layers keep a recurrent state per request, "
                 "which is not saved at block boundaries)")
    return replace(config, cache=replace(config.cache, enable_prefix_caching=False))


class Engine:
    def __init__(self, config: EngineConfig):
        if config.load.model is None:
            raise ValueError("The engine needs a model path; resolve the default with model.source.resolve_model.")
        self.model_dir = config.load.model
        self.tok = Tokenizer(self.model_dir, config.load.tokenizer)
        config = _hybrid_rules(config, self.tok.facts.hf)
        # the LoRA adapters (--lora-modules, runtime loads); a request's `params.lora` must name one
        self.loras = LoraTable(config, self.tok.facts)
        self.max_model_len = self.tok.facts.max_len(config.scheduler.max_model_len)
        explicit = isinstance(config.parallel.pp_layer_partition, tuple)    # kept on every node and rebuild
        self.config = config            # what the user asked for; what start-up works out is `resolved`
        # NOTE: a model this node cannot hold is refused before any stage loads (rebuilds reuse the fit)
        self.resolved = resolve_startup(config, self.tok.facts)
        self.policy = policy_for(config, config.load.resolved_device)
        for line in self.policy.log_lines:
            log.info(line)
        self.dead: str | None = None
        launch = self.resolved.launch_config(config)      # what stage processes (and their rebuilds) start with
        executor = start_pipeline(launch, self.model_dir, self.tok.eos_token_ids, keep_partition=explicit)
        log.info("memory plan per stage:\n%s", format_memory_table(executor.memory_plans))
        blocks = BlockManager(executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                              disk_tier_on(config))
        # NOTE: one request can never hold more than the whole cache (block 0 is reserved), so
        # a request stops with "length" there instead of waiting forever for blocks.
        self.kv_capacity_tokens = (blocks.num_blocks - 1) * config.cache.block_size
        self.max_len = min(self.max_model_len, self.kv_capacity_tokens)
        self.speculator = make_proposer(config.scheduler.speculative_config, self.max_len, config, self.tok, Engine)
        self.scheduler = Scheduler(blocks, config.scheduler.max_num_seqs, config.scheduler.chunked_prefill_size,
                                   stop_rule=self._stop_rule, speculator=self.speculator)
        self.inflight: deque[StepPlan] = deque()
        self.inbox: deque = deque()
        self.supervisor = PipelineSupervisor(launch, self.model_dir, self.tok.eos_token_ids, executor, self.scheduler,
                                             keep_partition=explicit)
        clocks = balance_scheduler(self.scheduler, executor, self.policy, config.parallel.depth,
                                   config.scheduler.dynamic_chunking, self.tok.vocab_size, self.max_len)
        # NOTE: unset --pp-depth: plans in flight grow from the stage count while links idle the stages
        par = config.parallel
        self.link_depth = LinkDepth(par.pp_size, 4 * par.pp_size) if par.pp_depth is None and par.pp_size > 1 else None
        shares = predicted_shares(config, self.tok.facts, self.resolved.partition)
        self.stats_ = EngineStats(self.policy, shares, clocks)
        self._ids = itertools.count()
        self._grammars: StructuredOutputManager | None = None    # made at the first constrained request
        self.grammar_limits = GrammarLimits.of(config.limits)

    @property
    def executor(self) -> Executor:
        return self.supervisor.executor

    @property
    def lora_names(self) -> tuple[str, ...]:
        return self.loras.names

    @property
    def lora_runtime_updates(self) -> bool:
        return self.loras.runtime

    def load_lora(self, name: str, path: str, base_names: tuple[str, ...] = ()) -> None:
        """vLLM's runtime LoRA load (--enable-lora-runtime-updates): read and checked here; requests may
        name it at once (every stage reads it before their rows run). ValueError: one sentence."""
        self.loras.load(name, path, base_names)

    def unload_lora(self, name: str) -> None:
        """Drop a LoRA adapter; LoraNotFoundError or LoraInUseError (unfinished requests run on it)."""
        queued = [item for kind, item in self.inbox if kind == "add"]
        self.loras.unload(name, [*self.scheduler.requests.values(), *queued])

    # requests (any thread)
    def add_request(self, prompt=None, params: SamplingParams | None = None, *, prompt_token_ids=None,
                    input_embeds=None, request_id: str | None = None, tenant: int | None = None) -> Request:
        """Validate and queue a request; raises ValueError with one sentence on bad input. `tenant`:
        whose request it is (the server's API key place); waiting requests alternate between tenants."""
        if self.dead:
            raise EngineDeadError(self.dead)
        lora = params.lora if params is not None else None
        if lora is not None and lora not in self.lora_names:
            raise ValueError(f"The LoRA adapter {lora[:200]!r} is not loaded; this engine holds "
                             f"{', '.join(self.lora_names) or 'none'} (see --lora-modules).")
        req = make_request(self.tok, lambda: request_id or f"req-{next(self._ids)}", prompt, params or SamplingParams(),
                           prompt_token_ids, input_embeds, self.max_model_len, self.kv_capacity_tokens)
        req.tenant = tenant
        req.lora_key = self.loras.key(lora)
        self.inbox.append(("add", req))
        return req

    def abort(self, request_id: str) -> None:
        self.inbox.append(("abort", request_id))

    def fault(self) -> str | None:
        """Why the engine cannot go on, or None. A stage that died while the engine idled shows
        here too: an idle engine never calls the executor, but the executor's monitor flags it;
        a pipeline that can be rebuilt starts `recovering` instead (the next `step` rebuilds it)."""
        try:
            if not self.dead:
                self.supervisor.poll()
            if not self.dead and not self.recovering and self.executor.dead:
                self._lost(self.executor.dead)
        except EngineDeadError:
            pass
        return self.dead

    @property
    def recovering(self) -> str | None:
        """Why the pipeline is being rebuilt, while it is (the next `step` rebuilds it)."""
        return self.supervisor.recovering

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.inbox or self.inflight or self.recovering)

    # the step loop
    def step(self) -> StepOutputs:
        """Outputs of requests that changed; `.progressed` is False when nothing could be scheduled
        or collected (the caller should wait for new requests instead of spinning)."""
        try:
            if self.supervisor.tend():
                self.stats_.pipeline_rebuilt()        # new stage processes count busy time from 0
                self.loras.rebuilt()
        except Unrecoverable as exc:
            self._die(str(exc))
        outputs = self._drain_inbox() + self._fail_refused_grammars()
        try:
            self._submit_plans()
            collected = self._collect() if self.inflight else None
        except EngineDeadError as exc:
            return StepOutputs(outputs + self._lost(str(exc)), progressed=True)
        if collected is None:
            return StepOutputs(outputs, progressed=bool(outputs))
        return StepOutputs(outputs + self._apply(*collected), progressed=True)

    def run_until_done(self) -> Iterator[RequestOutput]:
        """Step until no request is unfinished, yielding every output (the offline loop of `LLM`
        and `stagewise generate`; serving runs `EngineCore` instead)."""
        while self.has_unfinished():
            out = self.step()
            if not out.progressed and self._grammars is not None:
                self._grammars.wait(0.05)
            yield from out

    def _submit_plans(self) -> None:
        """Schedule and submit plans until `depth` are in flight or nothing more can be scheduled."""
        depth = self.link_depth.depth if self.link_depth is not None else self.config.parallel.depth
        while len(self.inflight) < depth and (plan := self.scheduler.schedule()) is not None:
            decode_only = all(s.num_tokens == 1 and s.start > 0 for s in plan.seqs)
            plan.verdict = decide_verdict(self.policy, plan.num_tokens, decode_only, len(plan.seqs))
            if plan.seqs:                        # a plan of disk-tier page work only runs no forward
                self.stats_.record_verdict(plan.verdict, plan.num_tokens)
            if self._grammars is not None:
                plan.token_bitmask = self._grammars.fill(plan)
            plan.loras = self.loras.take()
            if not self.inflight:
                self.stats_.pipeline_started()
            self.inflight.append(plan)       # NOTE: before submit: a plan the link lost was in flight
            if self.link_depth is not None:
                self.link_depth.sent(plan.plan_id, time.monotonic())
            self.executor.submit(plan)

    def _collect(self) -> tuple[StepPlan, StepResult]:
        """The oldest plan in flight and its result (a failure leaves the plan in flight)."""
        result = self.executor.collect()
        plan = self.inflight.popleft()
        if not self.inflight:
            self.stats_.pipeline_drained()
        return plan, result

    def _apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        if result.plan_id != plan.plan_id:
            self._die(f"Stage results arrived out of order (expected plan {plan.plan_id}, "
                      f"got {result.plan_id}); the pipeline is inconsistent.")
        self.stats_.record_result(result)
        self._tune_depth(plan)
        self.supervisor.applied(plan, result)
        if self._grammars is not None:
            self._grammars.settle(plan, result)
        if result.failed:
            mark_request_faults(result.failed, self.scheduler.requests, (NO_TOKEN_LEFT,))
        changed = self.scheduler.update(plan, result)
        failed = [r for r in changed if r.finish_reason is FinishReason.ERROR]
        if failed:
            log.warning("%d request(s) failed: %s", len(failed), failed[0].error)
        return self._outputs(changed)

    def _tune_depth(self, plan: StepPlan) -> None:
        """Unset --pp-depth: one more plan in flight while the busiest stage waits on links."""
        if self.link_depth is None:
            return
        depth = self.link_depth.observe(plan.plan_id, time.monotonic(), self.stats_.stage_busy_s,
                                        self.stats_.active_seconds(), self.scheduler.fillable_plans(LinkDepth.MIN_ROWS))
        if self.scheduler.balancer.depth > 1 and depth != self.scheduler.balancer.depth:
            log.info("plans in flight: %d (the busiest stage waited on links)", depth)
            self.scheduler.balancer.depth = depth

    def _lost(self, why: str) -> list[RequestOutput]:
        """The executor failed: the supervisor fails its cause (or all: `_die`); the plans in flight are gone."""
        try:
            failed = self.supervisor.lost(why, self.inflight)
        except Unrecoverable as exc:
            self._die(str(exc))
        self.inflight.clear()
        self.stats_.pipeline_drained()
        return self._outputs(failed)

    def _stop_rule(self, req: Request) -> FinishReason | None:
        """The output rules (EOS, stops, lengths), and a complete grammar ends its output."""
        reason = finish_check(req, self.tok, self.max_len)
        if reason is None and self._grammars is not None and self._grammars.is_terminated(req.request_id):
            reason = finish_text(req, self.tok)
        return reason

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        for req in changed:
            if req.is_finished:
                self.supervisor.finished(req.request_id)
                self.stats_.record_finish(req)
                if self._grammars is not None:
                    self._grammars.release(req.request_id)
        return [make_output(req) for req in changed]

    def _drain_inbox(self) -> list[RequestOutput]:
        changed = []
        while self.inbox:
            kind, item = self.inbox.popleft()
            if kind == "add":
                if item.params.grammar is not None:
                    self._structured().submit(item)      # it starts once its grammar is compiled
                self.scheduler.add(item)
            elif (aborted := self.scheduler.abort(item)) is not None:
                changed.append(aborted)
        return self._outputs(changed)

    def _structured(self) -> StructuredOutputManager:
        if self._grammars is None:
            self._grammars = StructuredOutputManager(self.tok.tokenizer, self.tok.vocab_size, self.tok.eos_token_ids,
                                                     self.grammar_limits)
            self.scheduler.admission_rules.append(self._grammars.admits)
        return self._grammars

    def _fail_refused_grammars(self) -> list[RequestOutput]:
        """Fail the requests whose grammar could not be compiled (the others may start now)."""
        if self._grammars is None or not self._grammars.pending:
            return []
        failed = [r for req, why in self._grammars.take_failed() for r in self.scheduler.fail([req.request_id], why)]
        return self._outputs(failed)

    def _die(self, why: str) -> NoReturn:
        """A fatal executor fault: fail every request with the reason and refuse new ones."""
        self.dead = why
        log.error("engine failed: %s", why)
        outputs = self._outputs(self.scheduler.fail_all(why))
        self.inflight.clear()
        self.shutdown()
        raise EngineDeadError(why, outputs)

    def _save_pages(self) -> None:
        """Blocks registered by the last steps go to the disk tier with one more plan (a restart finds
        them), when nothing else runs."""
        if self.dead or self.recovering or self.inflight or self.scheduler.waiting or self.scheduler.running:
            return
        try:
            if (plan := self.scheduler.schedule()) is not None:
                self.inflight.append(plan)
                self.executor.submit(plan)
                self._apply(*self._collect())
        except Exception as exc:  # noqa: BLE001 (shutting down: the pages are only an optimisation)
            log.warning("The last KV pages were not saved: %s", exc)

    def stats(self) -> dict:
        snapshot = self.stats_.snapshot(self.scheduler, self.executor)
        snapshot["recovery"] = self.supervisor.stats()
        snapshot["pp_depth"] = self.link_depth.depth if self.link_depth is not None else self.config.parallel.depth
        if self.speculator is not None:
            snapshot["speculative"] = self.speculator.stats.snapshot()
        return snapshot

    def shutdown(self) -> None:
        self._save_pages()
        if self._grammars is not None:
            self._grammars.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        self.supervisor.shutdown()

