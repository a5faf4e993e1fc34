"""Bind a stage forward's optional inputs by name, from its signature.

`input_embeds`/`inputs_embeds` (whichever is declared first) and `pp_proxy_tensors` are
always passed as keywords and only when declared; the required `input_ids, positions, batch`
stay positional. Checked once at startup: a non-first stage must accept the proxy.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

EMBEDS_NAMES = ("input_embeds", "inputs_embeds")
PROXY_NAME = "pp_proxy_tensors"


@dataclass(frozen=True)
class ForwardBinding:
    """Which optional keywords a forward takes."""

    embeds_name: str | None     # "input_embeds" | "inputs_embeds" | None
    takes_proxy: bool

    def kwargs(self, input_embeds: Any = None, proxy: Any = None) -> dict[str, Any]:
        """Keyword arguments for one call: the embeds keyword whenever declared (None is a value),
        the proxy only when one exists."""
        out: dict[str, Any] = {}
        if self.embeds_name is not None:
            out[self.embeds_name] = input_embeds
        elif input_embeds is not None:
            raise ValueError("This model's forward takes no input_embeds/inputs_embeds, "
                             "so requests with prompt embeddings cannot run on it.")
        if proxy is not None and self.takes_proxy:
            out[PROXY_NAME] = proxy
        return out


def bind_forward(forward: Callable, stage_rank: int, is_first: bool) -> ForwardBinding:
    """Inspect `forward` once; a non-first stage whose forward lacks `pp_proxy_tensors` is an error."""
    params = inspect.signature(forward).parameters
    # NOTE: **kwargs does not count as declaring a name: we pass only names the signature spells.
    named = [name for name, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    embeds_name = next((n for n in named if n in EMBEDS_NAMES), None)
    takes_proxy = PROXY_NAME in named
    if not is_first and not takes_proxy:
        qualname = getattr(forward, "__qualname__", repr(forward))
        raise ValueError(f"Stage {stage_rank} is not the first pipeline stage, but {qualname} declares no "
                         f"'{PROXY_NAME}' parameter, so it could not receive the previous stage's activations; "
                         f"add `{PROXY_NAME}=None` to its signature.")
    return ForwardBinding(embeds_name, takes_proxy)
