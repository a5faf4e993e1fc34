"""Prompt intake: the tokenizer wrapper and the checks every request passes before it is queued."""
from __future__ import annotations

from typing import Callable

from ..errors import PromptTooLongError
from ..request import Request, SamplingParams


class Tokenizer:
    """The checkpoint's HF tokenizer plus the facts the engine needs from it and its config."""

    def __init__(self, model_dir: str, tokenizer_dir: str | None = None):
        from ..checkpoint.facts import read_facts
        from ..checkpoint.files import load_tokenizer
        self.facts = facts = read_facts(model_dir)
        self.tokenizer = load_tokenizer(tokenizer_dir or model_dir)
        # NOTE: the engine checks prompt lengths against its own context (one sentence); HF's
        # "Token indices sequence length is longer than ..." warning would only repeat it, worse.
        self.tokenizer.model_max_length = int(1e30)
        self.eos_token_ids = facts.eos_token_ids
        self.vocab_size = facts.vocab
        self.hidden_size = facts.hidden

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # NOTE: the Rust backend directly: the Python wrapper costs more than the decode itself,
        # and outputs are re-decoded every step.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The conversation rendered by the model's chat template (or `chat_template`); vLLM's
        controls: no generation prompt, continuing the final message, extra template variables."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This model's tokenizer has no chat template; use a plain completion prompt instead.")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message,
                                                  chat_template=chat_template, tokenize=False,
                                                  **(template_kwargs or {}))

    def encode_prompt(self, prompt, prompt_token_ids, input_embeds):
        """Exactly one of the three; returns (token ids, embeddings or None)."""
        given = [x is not None for x in (prompt, prompt_token_ids, input_embeds)]
        if sum(given) != 1:
            raise ValueError("Give exactly one of prompt, prompt_token_ids or input_embeds per request.")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, not {type(prompt).__name__}.")
            if not prompt:
                raise ValueError("prompt is empty; give at least one character.")
            return self.encode(prompt), None
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids) if isinstance(prompt_token_ids, (list, tuple)) else None
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a non-empty list of integers.")
            return ids, None
        return [], _check_embeds(input_embeds, self.hidden_size)


def _check_embeds(embeds, hidden_size: int):
    import torch
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or not embeds.is_floating_point():
        raise ValueError("input_embeds must be a float tensor of shape [num_tokens, hidden_size].")
    if embeds.shape[0] == 0 or embeds.shape[1] != hidden_size:
        raise ValueError(f"input_embeds has shape {tuple(embeds.shape)}; expected [num_tokens >= 1, {hidden_size}].")
    if not torch.isfinite(embeds).all():
        raise ValueError("input_embeds holds NaN or infinite values.")
    return embeds.detach().cpu()


def make_request(tok: Tokenizer, new_id: Callable[[], str], prompt, params: SamplingParams, prompt_token_ids,
                 input_embeds, max_model_len: int, kv_capacity_tokens: int) -> Request:
    """A checked request, named by `new_id()`; ValueError with one sentence on bad input."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}.")
    ids, embeds = tok.encode_prompt(prompt, prompt_token_ids, input_embeds)
    ids, embeds = truncate_prompt(ids, embeds, params, max_model_len)
    if params.bad_words and params.bad_words_token_ids is None:
        params.bad_words_token_ids = bad_words_token_ids(tok, params.bad_words)
    req = Request(new_id(), ids, params, prompt=prompt if isinstance(prompt, str) else None,
                  input_embeds=embeds, eos_token_ids=() if params.ignore_eos else tok.eos_token_ids)
    check_prompt(req, max_model_len, kv_capacity_tokens, tok.vocab_size)
    return req


def check_prompt(req: Request, max_model_len: int, kv_capacity_tokens: int, vocab_size: int) -> None:
    bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size}).")
    p = req.params
    for name, ids in (("logit_bias", p.logit_bias or ()), ("allowed_token_ids", p.allowed_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} holds the token id {bad[0]}, outside the vocabulary [0, {vocab_size}).")
    if req.input_embeds is not None and req.params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs needs a prompt of text or token ids; an input_embeds prompt has no "
                         "tokens to score.")
    if req.num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(f"The prompt has {num_tokens(req.num_prompt_tokens)} but the model's context is "
                                 f"{max_model_len}; shorten the prompt to leave room for output.")
    if req.num_prompt_tokens >= kv_capacity_tokens:
        raise PromptTooLongError(f"The prompt has {num_tokens(req.num_prompt_tokens)} but the KV cache holds "
                                 f"{kv_capacity_tokens}; raise kv_cache_memory or shorten the prompt.")


def truncate_prompt(ids: list[int], embeds, params: SamplingParams, max_model_len: int):
    """vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: the model's context)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids, embeds
    k = max_model_len if k == -1 else k
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens must be at most the model's context ({max_model_len}), got {k}.")
    return ids[-k:], (None if embeds is None else embeds[-k:])


def bad_words_token_ids(tok, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word's tokens as written (leading spaces stripped) and, when it differs in
    its first token only, with one leading space (the word inside a sentence)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tok.tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return [s for s in sequences if s]


def num_tokens(n: int) -> str:
    """'1 token', '2 tokens'."""
    return f"{n} token" if n == 1 else f"{n} tokens"


def check_request(tok, facts, params, prompt_token_ids=None, input_embeds=None) -> None:
    """The checks `Engine.add_request` makes, for a client that holds only the tokenizer and the
    engine's facts (`max_model_len`, `kv_capacity_tokens`, `vocab_size`), so bad input is refused
    before anything is sent to the engine."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, not {type(params).__name__}.")
    # NOTE: called on the class: the client's tokenizer may be any object with `hidden_size`
    ids, embeds = Tokenizer.encode_prompt(tok, None, prompt_token_ids, input_embeds)
    check_prompt(Request("check", ids, params, input_embeds=embeds), facts.max_model_len, facts.kv_capacity_tokens,
                 facts.vocab_size)
