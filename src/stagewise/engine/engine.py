"""Engine: the driver. Owns tokenizer, scheduler and executor; `step()` is the spine:
schedule → submit (up to `depth` plans in flight) → collect the oldest → apply. Request state
changes only through the scheduler (`update`, `finish`), whatever the number of stages.

A pipeline (pp_size or tp_size > 1, not torchrun) heals: when a stage process dies, hangs or loses a link,
`step` tears the pipeline down, starts it again (new processes and links; across
nodes, the remote nodes rejoin, or their stages move to node 0: engine/placement.py) and
recomputes every live request from its tokens, as preemption does (engine/recovery.py has the
restart budget and the poison-plan rule). `recovering` says why while that is under way.

`add_request` and `abort` may be called from other threads: they only validate and post
to an inbox that `step()` drains. Callers outside `engine/` use this class's surface only
(`step`, `fault`, `kv_capacity_tokens`, `stats`), never the scheduler or the executor.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Iterator, NoReturn

from .. import envs
from ..checkpoint import max_model_len, num_layers_of
from ..config import EngineConfig
from ..errors import EngineDeadError
from ..executor import Executor, make_executor
from ..executor.generations import await_nodes, end_generations, next_generation, ready_nodes
from ..executor.layout import default_layout, stages_of
from ..executor.multiproc import MultiprocExecutor
from ..executor.rendezvous import torchrun_env
from ..executor.spawn import spares_ready, start_spares, stop_spares
from ..graph.policy import decide_verdict, policy_for
from ..parallel.partition import stage_infos
from ..plan import StepPlan, StepResult
from ..request import FinishReason, Request, RequestOutput, RequestStatus, SamplingParams
from ..runtime.memory import format_memory_table
from ..runtime.plan_report import fit_to_memory
from ..runtime.sampler import NO_TOKEN_LEFT
from ..runtime.stage_cost import cost_model_for, partition_lines, stage_rates, with_resolved_partition
from ..runtime.threads import usable_cpus
from .balance import DecodeBalancer
from .block_manager import BlockManager
from .grammar.limits import GrammarLimits
from .grammar.matchers import StructuredOutputManager
from .inputs import Tokenizer, bad_words_token_ids, check_prompt, truncate_prompt
from .outputs import StepOutputs, finish_check, finish_text, make_output, mark_request_faults
from .placement import available_bytes, fit_problem, layout_line, place_stages
from .profile import fitted_chunker
from .recovery import RecoveryStats, RestartBudget, Suspects, poison_message
from .scheduler import Scheduler
from .speculative import NgramProposer
from .stats import EngineStats

log = logging.getLogger("stagewise.engine")
NODE_CHECK_S = 1.0             # how often a pipeline with a node left out looks for it
NODE_RETURNED = "node_returned"    # the cause of a rebuild that gives a returned node its stages back


class Engine:
    def __init__(self, config: EngineConfig):
        if config.model is None:
            raise ValueError("The engine needs a model path; resolve the default with model.source.resolve_model.")
        self.config = config
        self.model_dir = config.model
        self.tok = Tokenizer(self.model_dir, config.tokenizer)
        self.max_model_len = max_model_len(config, self.tok.hf_config)
        # NOTE: a bad partition is a clear error here, before any stage process starts; stages get
        # the resolved counts (an `auto` split is computed once, here).
        if config.pp_size > 1:
            for line in partition_lines(config, self.tok.hf_config):     # says how the split was chosen
                log.info(line)
            config = self.config = with_resolved_partition(config, self.tok.hf_config)
        stage_infos(num_layers_of(self.tok.hf_config, self.model_dir), config.pp_size, config.pp_layer_partition)
        self.policy = policy_for(config, config.resolved_device)
        for line in self.policy.log_lines:
            log.info(line)
        # NOTE: a model this node cannot hold is refused here, before any stage loads; stages (and
        # rebuilt ones) share the node memory measured now.
        config = self.config = fit_to_memory(config, self.tok.hf_config)
        self.executor = make_executor(config, self.model_dir, self.tok.eos_token_ids)
        log.info("memory plan per stage:\n%s", format_memory_table(self.executor.memory_plans))
        blocks = BlockManager(self.executor.num_blocks, config.block_size, config.enable_prefix_caching)
        # NOTE: one request can never hold more than the whole cache (block 0 is reserved), so
        # a request stops with "length" there instead of waiting forever for blocks.
        self.kv_capacity_tokens = (blocks.num_blocks - 1) * config.block_size
        self.max_len = min(self.max_model_len, self.kv_capacity_tokens)
        spec = config.speculative_config
        self.speculator = NgramProposer(spec, self.max_len) if spec is not None else None
        self.scheduler = Scheduler(blocks, config.max_num_seqs, config.chunked_prefill_size,
                                   stop_rule=self._stop_rule,
                                   speculator=self.speculator)
        self.inflight: deque[StepPlan] = deque()
        self.inbox: deque = deque()
        clocks = self._balance(config, blocks)
        self.stats_ = EngineStats(self.policy, self._predicted_shares(config), clocks)
        self._ids = itertools.count()
        self.dead: str | None = None
        # NOTE: not under torchrun: its agent, not this process, would have to restart the other ranks
        # (across nodes, the other nodes' `run_headless` rejoins each pipeline this driver builds).
        self.heals = (config.pp_size > 1 or config.tp_size > 1) and torchrun_env() is None
        self.restarts = RestartBudget(config.max_pipeline_restarts, config.pipeline_restart_window_s)
        self.suspects = Suspects()
        self.scheduler.gate = self.suspects.may_admit
        self.recovery = RecoveryStats()
        self._spares_due: float | None = time.monotonic() + config.pipeline_spares_delay_s
        self._node_check_at = 0.0
        self._rejoin_s = 0.0           # the last rebuild's wait for the other nodes to be ready
        self._grammars: StructuredOutputManager | None = None    # made at the first constrained request
        self.grammar_limits = GrammarLimits.of(config)

    # requests (any thread)
    def add_request(self, prompt=None, params: SamplingParams | None = None, *, prompt_token_ids=None,
                    input_embeds=None, request_id: str | None = None) -> Request:
        """Validate and queue a request; raises ValueError with one sentence on bad input."""
        if self.dead:
            raise EngineDeadError(self.dead)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}.")
        ids, embeds = self.tok.encode_prompt(prompt, prompt_token_ids, input_embeds)
        ids, embeds = truncate_prompt(ids, embeds, params, self.max_model_len)
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tok, params.bad_words)
        req = Request(request_id or f"req-{next(self._ids)}", ids, params,
                      prompt=prompt if isinstance(prompt, str) else None,
                      input_embeds=embeds, eos_token_ids=() if params.ignore_eos else self.tok.eos_token_ids)
        check_prompt(req, self.max_model_len, self.kv_capacity_tokens, self.tok.vocab_size)
        self.inbox.append(("add", req))
        return req

    def abort(self, request_id: str) -> None:
        self.inbox.append(("abort", request_id))

    def fault(self) -> str | None:
        """Why the engine cannot go on, or None. A stage that died while the engine idled shows
        here too: an idle engine never calls the executor, but the executor's monitor flags it;
        a pipeline that can be rebuilt starts `recovering` instead (the next `step` rebuilds it)."""
        self._start_spares_when_due()
        self._welcome_returned_nodes()
        if not self.dead and not self.recovering and self.executor.dead:
            try:
                self._lost(self.executor.dead)
            except EngineDeadError:
                pass
        return self.dead

    @property
    def recovering(self) -> str | None:
        """Why the pipeline is being rebuilt, while it is (the next `step` rebuilds it)."""
        return self.recovery.recovering

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.inbox or self.inflight or self.recovering
                    or (self._grammars is not None and self._grammars.pending))

    # the step loop
    def step(self) -> StepOutputs:
        """Outputs of requests that changed; `.progressed` is False when nothing could be scheduled
        or collected (the caller should wait for new requests instead of spinning)."""
        if self.recovering:
            self._rebuild()
        self._start_spares_when_due()
        self._welcome_returned_nodes()
        outputs = self._drain_inbox() + self._admit_compiled()
        while len(self.inflight) < self.config.depth:
            plan = self.scheduler.schedule()
            if plan is None:
                break
            plan.verdict = self._verdict(plan)
            if self._grammars is not None:
                plan.token_bitmask = self._grammars.fill(plan)
            if not self.inflight:
                self.stats_.pipeline_started()
            self.inflight.append(plan)       # NOTE: before submit: a plan the link lost was in flight
            try:
                self.executor.submit(plan)
            except EngineDeadError as exc:
                return StepOutputs(outputs + self._lost(str(exc)), progressed=True)
        if not self.inflight:
            return StepOutputs(outputs, progressed=bool(outputs))
        try:
            result = self.executor.collect()
        except EngineDeadError as exc:
            return StepOutputs(outputs + self._lost(str(exc)), progressed=True)
        plan = self.inflight.popleft()
        if not self.inflight:
            self.stats_.pipeline_drained()
        if result.plan_id != plan.plan_id:
            self._die(f"Stage results arrived out of order (expected plan {plan.plan_id}, "
                      f"got {result.plan_id}); the pipeline is inconsistent.")
        return StepOutputs(outputs + self._apply(plan, result), progressed=True)

    def run_until_done(self) -> Iterator[RequestOutput]:
        """Step until no request is unfinished, yielding every output (the offline loop of `LLM`
        and `stagewise generate`; serving runs `EngineCore` instead)."""
        while self.has_unfinished():
            out = self.step()
            if not out.progressed and self._grammars is not None:
                self._grammars.wait(0.05)
            yield from out

    def _balance(self, config: EngineConfig, blocks: BlockManager) -> list[float]:
        """Micro-batch balancing and, when enabled, dynamic chunk sizing: its start-up profile runs
        here, before any request, and leaves the prefix-cache counters as they were. Returns the
        stages' busy clocks after it (empty: nothing ran)."""
        self.scheduler.balancer = DecodeBalancer(config.depth if envs.STAGEWISE_BALANCE_MICRO_BATCHES else 1)
        if not config.dynamic_chunking:
            return []
        counters = blocks.num_queried_tokens, blocks.num_hit_tokens
        self.scheduler.chunker, clocks = fitted_chunker(self.scheduler, self.executor, self.policy,
                                                        self.tok.vocab_size, self.max_len)
        blocks.num_queried_tokens, blocks.num_hit_tokens = counters
        return clocks

    def _predicted_shares(self, config: EngineConfig) -> list[float]:
        if config.pp_size == 1:
            return [1.0]
        assert isinstance(config.pp_layer_partition, tuple), "resolved in __init__"
        return cost_model_for(config, self.tok.hf_config).shares(config.pp_layer_partition, stage_rates(config))

    def _verdict(self, plan: StepPlan):
        decode_only = all(s.num_tokens == 1 and s.start > 0 for s in plan.seqs)
        verdict = decide_verdict(self.policy, plan.num_tokens, decode_only, len(plan.seqs))
        self.stats_.record_verdict(verdict, plan.num_tokens)
        return verdict

    def _apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        self.stats_.record_result(result)
        self.suspects.cleared(s.request_id for s in plan.seqs)
        if result.sampled:
            self.recovery.token_applied()
        if self._grammars is not None:
            self._grammars.settle(plan, result)
        if result.failed:
            mark_request_faults(result.failed, self.scheduler.requests, (NO_TOKEN_LEFT,))
        changed = self.scheduler.update(plan, result)
        failed = [r for r in changed if r.finish_reason is FinishReason.ERROR]
        if failed:
            log.warning("%d request(s) failed: %s", len(failed), failed[0].error)
        return self._outputs(changed)

    def _stop_rule(self, req: Request) -> FinishReason | None:
        """The output rules (EOS, stops, lengths), and a complete grammar ends its output."""
        reason = finish_check(req, self.tok, self.max_len)
        if reason is None and self._grammars is not None and self._grammars.is_terminated(req.request_id):
            reason = finish_text(req, self.tok)
        return reason

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        for req in changed:
            if req.is_finished:
                self.suspects.cleared([req.request_id])
                self.stats_.record_finish(req)
                if self._grammars is not None:
                    self._grammars.release(req.request_id)
        return [make_output(req) for req in changed]

    def _drain_inbox(self) -> list[RequestOutput]:
        changed = []
        while self.inbox:
            kind, item = self.inbox.popleft()
            if kind == "add" and item.params.grammar is not None:
                self._structured().submit(item)      # scheduled once its grammar is compiled
            elif kind == "add":
                self.scheduler.add(item)
            elif (aborted := self.scheduler.abort(item)) is not None:
                changed.append(aborted)
            elif self._grammars is not None and (compiling := self._grammars.drop_pending(item)) is not None:
                _finish_unscheduled(compiling, FinishReason.ABORT)
                changed.append(compiling)
        return self._outputs(changed)

    def _structured(self) -> StructuredOutputManager:
        if self._grammars is None:
            self._grammars = StructuredOutputManager(self.tok.tokenizer, self.tok.vocab_size, self.tok.eos_token_ids,
                                                     self.grammar_limits)
        return self._grammars

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammars are ready; fail those whose compile failed."""
        if self._grammars is None or not self._grammars.pending:
            return []
        ready, failed = self._grammars.take_ready()
        for req in ready:
            self.scheduler.add(req)
        for req, why in failed:
            _finish_unscheduled(req, FinishReason.ERROR, why)
        return self._outputs([req for req, _ in failed])

    # recovery
    def _lost(self, why: str) -> list[RequestOutput]:
        """The pipeline failed: fail everything (`_die`) unless it can be rebuilt; else fail the
        poisoned requests alone, stop the stages and mark the engine recovering (the next `step`
        rebuilds). Returns the outputs of the requests that failed."""
        cause = getattr(self.executor, "cause", None) or "unknown"
        planned = cause == NODE_RETURNED           # not a failure: no restart used, no suspects
        if not self.heals or self.config.max_pipeline_restarts == 0:
            self._die(why)
        if not planned and not self.restarts.take():
            self._die(self.restarts.refusal(why))
        unfinished = self.scheduler.requests
        in_flight = [] if planned else [unfinished[rid] for rid in
                                        dict.fromkeys(s.request_id for p in self.inflight for s in p.seqs)
                                        if rid in unfinished]
        poisoned = []
        for rid, strikes in self.suspects.crash(in_flight).items():
            poisoned += self.scheduler.fail([rid], poison_message(strikes))
        self.inflight.clear()
        self.stats_.pipeline_drained()
        live = len(self.scheduler.requests)
        self.recovery.lost(cause, why, live, len(poisoned))
        log.log(logging.WARNING if planned else logging.ERROR, "pipeline %s: %s Rebuilding it; %d live request(s) "
                "will be recomputed%s.", "stopped" if planned else "failed", why, live,
                f", {len(poisoned)} that crashed it again fails" if poisoned else "")
        return self._outputs(poisoned)

    def _rebuild(self) -> None:
        """Tear the failed pipeline down, start a new one and requeue every live request for
        recompute. A start that fails uses the restart budget too."""
        t0 = time.monotonic()
        self.executor.shutdown()
        teardown_s = time.monotonic() - t0
        while True:
            try:
                self.executor = self._new_executor()
                break
            except EngineDeadError as exc:
                if self.dead:             # no room for a lost node's stages (_check_fits)
                    raise
                if not self.restarts.take():
                    self.recovery.recovering = None
                    self._die(self.restarts.refusal(str(exc)))
                log.error("%s Trying again.", exc)
        old = self.scheduler.blocks
        blocks = BlockManager(min(self.executor.num_blocks, old.num_blocks), old.block_size,
                              old.enable_prefix_caching)
        blocks.num_queried_tokens, blocks.num_hit_tokens = old.num_queried_tokens, old.num_hit_tokens
        self._start_spares()
        self.suspects.regroup([*self.scheduler.running, *self.scheduler.waiting])
        requeued = self.scheduler.restart(blocks)
        self.stats_.pipeline_rebuilt()
        startup = {**getattr(self.executor, "startup", {}), "rejoin_s": self._rejoin_s}
        self.recovery.rebuilt(teardown_s, startup, requeued)
        log.warning("pipeline rebuilt in %.1f s (teardown %.1f s, %sstart %.1f s, weights %.1f s); recomputing "
                    "%d request(s)", time.monotonic() - t0, teardown_s,
                    f"waiting for nodes {self._rejoin_s:.1f} s, " if self.config.nnodes > 1 else "",
                    startup.get("spawn_s", 0.0), startup.get("load_s", 0.0), requeued)

    def _new_executor(self) -> Executor:
        """A new pipeline. One node: on a fresh port (the old group's store and links may linger a
        while). Several: a new generation in the same store (executor/generations.py), on the nodes that
        are ready for it within --node-rejoin-timeout-s; the stages of the others run on node 0."""
        c = self.config
        if c.nnodes == 1:
            return make_executor(c.replace(master_port=None), self.model_dir, self.tok.eos_token_ids)
        addr, port = c.master_addr, c.master_port
        assert port is not None and isinstance(c.pp_layer_partition, tuple), "validated, resolved in __init__"
        generation = next_generation(addr, port)        # the first pipeline serves the store
        t0 = time.monotonic()
        present = await_nodes(addr, port, generation, list(range(1, c.nnodes)), c.node_rejoin_timeout_s)
        self._rejoin_s = time.monotonic() - t0
        placement = place_stages(default_layout(c.pp_size, c.nnodes), present)
        if placement.moved:
            self._check_fits(placement)
            log.warning("node %s did not rejoin within %.0f s; the pipeline runs on the nodes left: %s",
                        ", ".join(map(str, placement.gone)), c.node_rejoin_timeout_s,
                        layout_line(placement.layout, c.pp_layer_partition))
            local = len(stages_of(placement.layout, 0))
            c = c.replace(threads_per_stage=c.threads_per_stage or max(1, usable_cpus().cpus // local))
        return make_executor(c, self.model_dir, self.tok.eos_token_ids, generation=generation,
                             layout=placement.layout)

    def _welcome_returned_nodes(self) -> None:
        """Across nodes, once a second: a node left out of the pipeline (it did not rejoin in time)
        that is ready again stops the pipeline, and the rebuild gives it its stages back."""
        ex, c = self.executor, self.config
        generation = getattr(ex, "generation", None)
        if not isinstance(ex, MultiprocExecutor) or generation is None or not self.heals or self.recovering \
                or ex.dead or time.monotonic() < self._node_check_at:
            return
        self._node_check_at = time.monotonic() + NODE_CHECK_S
        left_out = sorted(set(range(1, c.nnodes)) - set(ex.layout))
        back = ready_nodes(c.master_addr, c.master_port, generation, left_out) if left_out and c.master_port else []
        if back:
            ex.stop(f"node {', '.join(map(str, back))} is back.", NODE_RETURNED)

    def _check_fits(self, placement) -> None:
        """Fail (one sentence) when node 0's memory cannot hold the moved stages and the live KV."""
        live = list(self.scheduler.requests.values())
        blocks = sum(-(-r.num_tokens // self.config.block_size) for r in live) + 1
        available = available_bytes() if self.config.resolved_device == "cpu" else None
        why = fit_problem(placement, self.executor.memory_plans, blocks, len(live), available,
                          self.config.node_rejoin_timeout_s)
        if why is not None:
            self.recovery.recovering = None
            self._die(why)

    def _start_spares(self) -> None:
        self._spares_due = None
        if self.heals and self.config.pipeline_spares and self.config.max_pipeline_restarts:
            start_spares(self.config.ranks_per_node, self.model_dir)

    def _start_spares_when_due(self) -> None:
        if self._spares_due is not None and time.monotonic() >= self._spares_due:
            self._start_spares()

    def _die(self, why: str) -> NoReturn:
        """A fatal executor fault: fail every request with the reason and refuse new ones."""
        self.dead = why
        log.error("engine failed: %s", why)
        failed = self.scheduler.fail_all(why)
        for rid in list(self._grammars.pending if self._grammars is not None else ()):
            req = self._grammars.drop_pending(rid) if self._grammars is not None else None
            if req is not None:
                _finish_unscheduled(req, FinishReason.ERROR, why)
                failed.append(req)
        outputs = self._outputs(failed)
        self.inflight.clear()
        self.shutdown()
        raise EngineDeadError(why, outputs)

    def stats(self) -> dict:
        snapshot = self.stats_.snapshot(self.scheduler, self.executor)
        snapshot["recovery"] = {**self.recovery.snapshot(), "spares_ready": spares_ready() if self.heals else 0}
        if self.speculator is not None:
            snapshot["speculative"] = self.speculator.stats.snapshot()
        return snapshot

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.shutdown()
        if self.config.nnodes > 1:
            end_generations()
        if self.heals:
            stop_spares()


def _finish_unscheduled(req: Request, reason: FinishReason, error: str | None = None) -> None:
    """Finish a request the scheduler never held (its grammar was still compiling)."""
    req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error

