"""LLM: the offline API (vLLM-style). Generates a batch to completion and returns one
RequestOutput per input, in input order, through the engine client a caller in this process uses
(core/client.py: `InprocClient`, the engine on this thread)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from .config import EngineConfig
from .core.client import InprocClient, PromptInput
from .errors import PromptTooLongError
from .model.source import resolve_models
from .multimodal.encoder import VisionEncoder
from .multimodal.families import vision_encoder
from .multimodal.images import limits_of
from .multimodal.messages import has_images, split_images
from .request import CompletionOutput, FinishReason, RequestOutput, SamplingParams

log = logging.getLogger("stagewise")


class LLM:
    """`LLM(model=PATH, **engine_options)`; options are EngineConfig fields. No model: the default model.
    `distributed_executor_backend="ray"` (with `pp_size` > 1): the pipeline's other nodes are placed on
    the Ray cluster at `ray_address` (default: $RAY_ADDRESS, else auto) and started there, as
    `stagewise serve --distributed-executor-backend ray` does; this process is the leader."""

    def __init__(self, model: str | None = None, *, distributed_executor_backend: str = "mp",
                 ray_address: str | None = None, **options):
        if distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got {distributed_executor_backend!r}.")
        self.config = resolve_models(EngineConfig.from_kwargs(model=model, **options))
        self._ray_nodes = None
        if distributed_executor_backend == "ray":
            from .cluster.ray_nodes import start_ray_nodes
            self.config, self._ray_nodes = start_ray_nodes(self.config, ray_address)
        try:
            self.client = InprocClient(self.config)
        except BaseException:
            self._stop_ray_nodes()
            raise
        self.engine = self.client.engine            # for callers that drive or inspect it (the CLI, tests)
        self.tokenizer = self.engine.tok.tokenizer
        self._vision: VisionEncoder | None = None

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, input_embeds=None,
                 use_tqdm: bool = True, lora_request: str | Sequence[str | None] | None = None
                 ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter (a `lora_modules` name) of every prompt, or one per prompt
        (None: the base model); the same as `SamplingParams(lora=name)`."""
        inputs = _inputs(prompts, prompt_token_ids, input_embeds)
        params = _params(sampling_params, len(inputs))
        if lora_request is not None:
            names = [lora_request] * len(inputs) if isinstance(lora_request, str) else list(lora_request)
            if len(names) != len(inputs):
                raise ValueError(f"lora_request has {len(names)} names for {len(inputs)} prompts; give one "
                                 f"name, or one per prompt.")
            params = [dataclasses.replace(p, lora=n) for p, n in zip(params, names)]
        return self._generate(inputs, params, use_tqdm)

    def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter (a PEFT directory or a GGUF LoRA file) while the engine runs; needs
        `enable_lora_runtime_updates=True`. ValueError: one sentence on why it cannot be served."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def _generate(self, inputs: list[PromptInput], params: list[SamplingParams], use_tqdm: bool
                  ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        order: list[str | RequestOutput] = []
        for inp, p in zip(inputs, params):
            try:
                order.append(self.client.submit(inp, p))
            except PromptTooLongError as exc:   # that request fails; the batch goes on
                order.append(_error_output(inp, str(exc)))
        self._run(results, sum(isinstance(o, str) for o in order), use_tqdm)
        return [results[o] if isinstance(o, str) else o for o in order]

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm)
        try:
            for out in self.client.outputs():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = False
             ) -> list[RequestOutput]:
        """One conversation (a list of message dicts) or a list of conversations. A message's `content`
        may be a list of parts: `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url":
        {"url": "data:image/png;base64,..."}}` or `{"type": "image", "image": <PIL image>}` (vision-language
        models; see docs/multimodal.md)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        inputs = [self._chat_input(c) for c in convs]
        return self._generate(inputs, _params(sampling_params, len(inputs)), use_tqdm)

    def _chat_input(self, conv: list[dict]) -> PromptInput:
        if not has_images(conv):
            flat, _ = split_images(conv, "")
            return PromptInput(text=self.engine.tok.chat_prompt(flat))
        return PromptInput(input_embeds=self.vision_encoder().chat(self.engine.tok, conv).input_embeds)

    def vision_encoder(self) -> VisionEncoder:
        """The driver's vision encoder (built on first use; a text-only model refuses images)."""
        if self._vision is None:
            self._vision = vision_encoder(str(self.engine.model_dir), limits_of(self.config.limits))
        return self._vision

    def score(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[float]:
        """Log-likelihood of each continuation after its prompt: the sum of the continuation tokens'
        logprobs, with prompt and continuation tokenized apart (as evaluation harnesses do)."""
        encode = self.engine.tok.encode
        pairs = [(encode(p), encode(c)) for p, c in zip(prompts, continuations, strict=True)]
        outs = self.generate(prompt_token_ids=[p + c for p, c in pairs], use_tqdm=False,
                             sampling_params=SamplingParams(max_tokens=0, prompt_logprobs=0))
        return [sum(e.logprob for e in (out.prompt_logprobs or [])[len(p):] if e is not None)
                for out, (p, _) in zip(outs, pairs)]

    def embed(self, prompts: str | Sequence[str] | None = None, *,
              prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[list[float]]:
        """One L2-normalised embedding per prompt: the last hidden state (after the final norm) pooled
        by the last token or the mean, as the checkpoint's sentence-transformers config or `pooling`
        says (docs/embeddings.md). Each prompt is one prefill through the pipeline; nothing is generated."""
        inputs = _inputs(prompts, prompt_token_ids, None)
        outs = self._generate(inputs, [SamplingParams(max_tokens=0, embed=True)] * len(inputs), False)
        for out in outs:
            if out.embedding is None:
                raise ValueError(out.outputs[0].error or "The embedding request ended without a vector.")
        return [list(out.embedding or ()) for out in outs]

    def stats(self) -> dict:
        return self.client.stats()

    def shutdown(self) -> None:
        try:
            self.client.stop()
        finally:
            self._stop_ray_nodes()      # after the driver ended: its nodes are leaving already

    def _stop_ray_nodes(self) -> None:
        if self._ray_nodes is not None:
            self._ray_nodes.close()
            self._ray_nodes = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _inputs(prompts, prompt_token_ids, input_embeds) -> list[PromptInput]:
    given = [x is not None for x in (prompts, prompt_token_ids, input_embeds)]
    if sum(given) != 1:
        raise ValueError("Pass exactly one of prompts, prompt_token_ids or input_embeds to generate().")
    if prompts is not None:
        items = [prompts] if isinstance(prompts, str) else prompts
        kind = "prompt"
    elif prompt_token_ids is not None:
        items = prompt_token_ids
        if items and isinstance(items[0], int):
            items = [items]
        kind = "prompt_token_ids"
    else:
        items = [input_embeds] if getattr(input_embeds, "dim", lambda: 0)() == 2 else input_embeds
        kind = "input_embeds"
    if not isinstance(items, (list, tuple)) and kind != "input_embeds":
        raise ValueError(f"{kind} must be a list, not {type(items).__name__}.")
    values: list[Any] = list(items)          # each checked by the engine as it is added
    if not values:
        raise ValueError(f"{kind} is empty; give at least one input.")
    if kind == "prompt":
        return [PromptInput(text=x) for x in values]
    if kind == "prompt_token_ids":
        return [PromptInput(prompt_token_ids=x) for x in values]
    return [PromptInput(input_embeds=x) for x in values]


def _params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"Got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt.")
    return params


def _error_output(inp: PromptInput, message: str) -> RequestOutput:
    return RequestOutput("rejected", inp.text, list(inp.prompt_token_ids or ()),
                         [CompletionOutput(0, "", [], FinishReason.ERROR.value, None, message)], finished=True)
