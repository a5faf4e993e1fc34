"""Static input buffers of one stage's graphs: allocated once, zero-filled,
never reallocated, because captured graphs read their addresses.

`fill` snapshots the live step into rows `[:T]` and zeroes `[T:B)`; `views(B)` hands capture
and replay the `[:B]` views of that same memory.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..parallel.partition import StageInfo
from ..parallel.proxy import ProxyTensors


class StaticInputs:
    """input_ids/positions `[max_tokens]`, input_embeds `[max_tokens, H]` (first stage),
    and one `[max_tokens, H]` proxy buffer per key on every non-first stage."""

    def __init__(self, stage: StageInfo, max_tokens: int, hidden_size: int, proxy_keys: Sequence[str],
                 dtype: torch.dtype, device: torch.device | str, with_embeds: bool = True):
        if max_tokens < 1:
            raise ValueError(f"Static graph buffers need at least one row, got max_tokens={max_tokens}.")
        self.stage, self.max_tokens, self.hidden_size, self.dtype = stage, max_tokens, hidden_size, dtype
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)               # [M]
        self.input_ids = (torch.zeros(max_tokens, dtype=torch.long, device=device)             # [M]
                          if stage.is_first else None)
        self.input_embeds = (torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)  # [M, H]
                             if stage.is_first and with_embeds else None)
        self.proxy: dict[str, torch.Tensor] = {} if stage.is_first else {
            key: torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device) for key in proxy_keys}  # [M, H] each

    def proxy_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(t.shape) for k, t in self.proxy.items()}

    def tensors(self) -> list[torch.Tensor]:
        extra = [t for t in (self.input_ids, self.input_embeds) if t is not None]
        return [self.positions, *extra, *self.proxy.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def views(self, bucket: int) -> dict:
        """The `[:B]` views capture binds to (same data_ptr as the buffers fill writes)."""
        return {
            "input_ids": None if self.input_ids is None else self.input_ids[:bucket],
            "positions": self.positions[:bucket],
            "input_embeds": None if self.input_embeds is None else self.input_embeds[:bucket],
            "proxy": ProxyTensors({k: t[:bucket] for k, t in self.proxy.items()}) if self.proxy else None,
        }

    def zero(self, bucket: int) -> None:
        """Rows `[:B)` of every buffer to zero: the capture inputs (token id 0, position 0)."""
        for t in self.tensors():
            t[:bucket].zero_()

    def fill(self, num_tokens: int, bucket: int, input_ids: torch.Tensor | None = None,
             positions: torch.Tensor | None = None, input_embeds: torch.Tensor | None = None,
             proxy: ProxyTensors | None = None) -> None:
        """Copy the live step into rows `[:T]` and zero rows `[T:B)` of every buffer."""
        T, B = num_tokens, bucket
        if not 0 < T <= B <= self.max_tokens:
            raise ValueError(f"Stage {self.stage.rank}: cannot fill {T} live tokens into bucket {B} "
                             f"(static buffers hold {self.max_tokens} rows).")
        self._copy("positions", self.positions, positions, T, B, (T,), None, required=True)
        if self.stage.is_first:
            self._copy("input_embeds", self.input_embeds, input_embeds, T, B, (T, self.hidden_size), self.dtype)
            self._copy("input_ids", self.input_ids, input_ids, T, B, (T,), None, required=input_embeds is None)
        else:
            self._fill_proxy(proxy, T, B)

    def _fill_proxy(self, proxy: ProxyTensors | None, T: int, B: int) -> None:
        expected = {k: (T, self.hidden_size) for k in self.proxy}
        if proxy is None:
            raise ValueError(f"Stage {self.stage.rank} got no proxy tensors from the previous stage; "
                             f"expected {expected}, got None.")
        extra = [k for k in proxy.keys() if k not in self.proxy]
        if extra:
            raise ValueError(f"Stage {self.stage.rank}: proxy key {extra[0]!r} is not one this stage's graphs "
                             f"read; expected keys {list(self.proxy)} with shapes {expected}.")
        for key, buf in self.proxy.items():
            # NOTE: an absent key (hidden-only proxy into a full buffer set) reads as zeros, which a
            # pre-norm family treats as "no residual yet"; stale rows from an older step never leak.
            self._copy(key, buf, proxy[key] if key in proxy else None, T, B, (T, self.hidden_size), self.dtype)

    def _copy(self, key: str, buf: torch.Tensor | None, live: torch.Tensor | None, T: int, B: int,
              shape: tuple[int, ...], dtype: torch.dtype | None, required: bool = False) -> None:
        """`dtype` None: any integer dtype (token ids, positions are widened by the copy)."""
        if buf is None:
            if live is not None:
                raise ValueError(f"Stage {self.stage.rank} has no static {key!r} buffer, but the step passed "
                                 f"one of shape {tuple(live.shape)}.")
            return
        if live is None:
            if required:
                raise ValueError(f"Stage {self.stage.rank}: {key!r} is missing; expected shape {shape}, got None.")
            buf[:B].zero_()
            return
        dtype_ok = live.dtype == dtype if dtype is not None else not (live.is_floating_point() or live.is_complex())
        if tuple(live.shape) != shape or not dtype_ok:
            raise ValueError(f"Stage {self.stage.rank}: {key!r} has shape {tuple(live.shape)} and dtype {live.dtype}, "
                             f"expected shape {shape} and dtype {dtype or 'an integer type'}.")
        buf[:T].copy_(live)      # a snapshot: later changes to `live` do not reach the graph
        buf[T:B].zero_()         # stale activations in padded rows can turn into NaN in a replay
