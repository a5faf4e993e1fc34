"""Tensor parallelism inside a stage: which rank holds which slice of a stage model, and the
collectives that join the slices (Megatron's layout, applied to a built model as gpt-fast does, so
the model files stay as they are).

Column-parallel by output rows: q/k/v (whole KV groups per rank, so every rank keeps the model's q
heads per KV head; `head_ranges`) and gate/up. Row-parallel by input columns: the attention output
(its columns follow the rank's q heads) and down projections, one all-reduce after each (their bias
counts once: rank 0 holds it, the others zeros). Vocabulary-parallel: the token embedding (each rank
looks up its own rows, one all-reduce joins them) and the LM head (each rank's logits, gathered
where sampling runs). `shard` narrows a model's parameters, on the meta device before loading or
loaded ones, and records each checkpoint tensor's `Slice` for the loader; `connect` adds the
collectives.
"""
from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..kernels.quant_formats import block_size

# OUT: row-parallel like ROW, its input columns following the rank's q heads (the attention output)
QKV, COLUMN, ROW, OUT, VOCAB = "qkv", "column", "row", "out", "vocab"
# module paths (fnmatch patterns) of each family -> style; families are named by their class
RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "LlamaForCausalLM": (("layers.*.self_attn.qkv_proj", QKV), ("layers.*.self_attn.o_proj", OUT),
                         ("layers.*.mlp.gate_up_proj", COLUMN), ("layers.*.mlp.down_proj", ROW),
                         ("embed_tokens", VOCAB), ("lm_head", VOCAB)),
    "GPT2LMHeadModel": (("layers.*.attn.c_attn", QKV), ("layers.*.attn.c_proj", OUT), ("layers.*.mlp.c_fc", COLUMN),
                        ("layers.*.mlp.c_proj", ROW), ("wte", VOCAB), ("lm_head", VOCAB)),
}


class Group(Protocol):
    """The collectives of one stage's ranks (kernels.comm.ShmGroup, or a test's stand-in)."""
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dst: int = -1) -> torch.Tensor: ...


@dataclass(frozen=True)
class Slice:
    """This rank's part of one checkpoint tensor: the `ranges` (start, length) along `dim`,
    concatenated, of a dimension `full` long; `zero`: the rank holds zeros of the whole tensor;
    `k`: `dim` is the weight's input features (a row-parallel layer), else its output rows."""
    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]
    zero: bool = False
    k: bool = False

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.full if d == self.dim else n for d, n in enumerate(local))

    def take(self, tensor: Any) -> Any:
        """This rank's part of the whole `tensor` (a torch tensor, or a kernels.quant.QuantizedWeight)."""
        if self.zero:
            return torch.zeros_like(tensor)
        if isinstance(tensor, torch.Tensor):
            return _cat(tensor, self.dim, self.ranges)
        return _take_quantized(tensor, self)


def _cat(t: torch.Tensor, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    parts = [t.narrow(dim, start, n) for start, n in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _take_quantized(weight: Any, piece: Slice) -> Any:
    """A quantized `[N, K]` matrix's rows by index (blocks run along a row, so rows never split one),
    or its columns (a row-parallel layer) as whole blocks (`aligned_scheme` keeps others float)."""
    if not piece.k:
        return weight.take_rows(torch.cat([torch.arange(s, s + n) for s, n in piece.ranges]))
    ((start, count),) = piece.ranges
    return weight.take_columns(start, count)


def aligned_scheme(model: nn.Module, scheme: Callable[[str, tuple[int, int]], Any]) -> Callable[..., Any]:
    """A quantization scheme (model.quantized.Scheme) for a sharded `model`, deciding as for the whole
    tensor: one split along its columns stays quantized only where this rank's columns start and end
    on the whole tensor's blocks (so it holds the one-process blocks; Q4_K's 256-wide blocks do not
    fit 192 columns); otherwise it is held float, dequantized at load (named in `model.tp_floats`)."""
    slices: dict[str, Slice] = model.__dict__.get("tp_slices", {})
    floats: list[str] = model.__dict__.setdefault("tp_floats", [])

    def sharded(hf_name: str, shape: tuple[int, int]) -> Any:
        piece = slices.get(hf_name)
        if piece is None or not piece.k:
            return scheme(hf_name, shape)
        qtype = scheme(hf_name, (shape[0], piece.full))
        if qtype is None:
            return None
        block = block_size(qtype)
        if all(start % block == 0 and count % block == 0 for start, count in piece.ranges):
            return qtype
        floats.append(f"{hf_name} ({qtype.name})")
        return None
    return sharded


def family_of(model_or_class: Any) -> str | None:
    """The family whose rules shard this model (by class, or any base class), or None."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return next((c.__name__ for c in cls.__mro__ if c.__name__ in RULES), None)


def head_ranges(num_heads: int, num_kv_heads: int, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first q head, q heads), (first kv head, kv heads) of `rank` of `size`. Splits follow KV groups,
    so every rank keeps the model's q heads per KV head (what the attention kernels assume): with at
    least as many KV heads as ranks, rank r holds KV heads [r * Hkv // size, (r + 1) * Hkv // size)
    and their groups' q heads (uneven where size does not divide Hkv); with fewer, each KV head is
    replicated on size / Hkv ranks, which split its group's q heads as evenly as they can."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        first, stop = rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size
        return (first * group, (stop - first) * group), (first, stop - first)
    sharing = size // num_kv_heads                  # ranks per KV head (check_sizes: a whole number)
    kv, sub = divmod(rank, sharing)
    lo, hi = sub * group // sharing, (sub + 1) * group // sharing
    return (kv * group + lo, hi - lo), (kv, 1)


def heaviest_rank(num_heads: int, num_kv_heads: int, size: int) -> int:
    """The rank holding the most KV heads, then q heads (the most weights and KV per block)."""
    def load(rank: int) -> tuple[int, int]:
        (_, q), (_, kv) = head_ranges(num_heads, num_kv_heads, rank, size)
        return kv, q
    return max(range(size), key=load)


def check_sizes(family: str | None, arch: str, num_heads: int, num_kv_heads: int, vocab: int, intermediate: int,
                size: int) -> None:
    """One sentence, before any process starts, if `size` ranks cannot split this model."""
    if size == 1:
        return
    if family is None:
        raise ValueError(f"Tensor parallelism supports the Llama (Llama, Mistral, Qwen2, Qwen3) and GPT-2 families; "
                         f"{arch} runs with tp_size 1.")
    if num_heads < size:
        raise ValueError(f"tp_size {size} is more than the model's {num_heads} attention heads (each rank needs "
                         f"one); use a tp_size of at most {num_heads}.")
    for what, count in (("vocabulary entries", vocab), ("MLP columns (intermediate size)", intermediate)):
        if count % size:
            raise ValueError(f"tp_size {size} does not divide the model's {count} {what}; use a tp_size that does.")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(f"tp_size {size} is not a multiple of the model's {num_kv_heads} KV heads (with fewer KV "
                         f"heads than ranks each KV head is replicated on the same number of ranks); use a tp_size "
                         f"of at most {num_kv_heads} or a multiple of it.")


def check_model(hf_config: Any, model_cls: type, size: int) -> None:
    """`check_sizes` for a checkpoint's transformers config and its model class."""
    heads = hf_config.num_attention_heads
    intermediate = (getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None)
                    or 4 * hf_config.hidden_size)
    check_sizes(family_of(model_cls), model_cls.__name__, heads, getattr(hf_config, "num_key_value_heads", None)
                or heads, hf_config.vocab_size, intermediate, size)


def shard(model: nn.Module, rank: int, size: int) -> nn.Module:
    """Narrow `model`'s parameters to `rank`'s slices (meta or real tensors, before any packing) and
    record each checkpoint tensor's Slice in `model.tp_slices` (by checkpoint name) for the loader."""
    family = family_of(model)
    if family is None:
        raise ValueError(f"Tensor parallelism has no rules for {type(model).__name__}.")
    heads, head_dim = model.kv_cache_spec()            # type: ignore[operator]  # the model contract
    slices: dict[str, Slice] = {}
    attentions: dict[int, Any] = {}
    for path, module in list(model.named_modules()):
        style = next((s for pattern, s in RULES[family] if fnmatch.fnmatchcase(path, pattern)), None)
        if style is None:
            continue
        if getattr(module, "packed", False):
            raise ValueError(f"{path} holds packed weights; shard a model before its weights are packed.")
        attn = model.get_submodule(path.rsplit(".", 1)[0]) if style in (QKV, OUT) else None
        for leaf in ("bias", "weight"):          # the weight last: it rewrites hf_parts to this rank's rows
            if isinstance(getattr(module, leaf, None), torch.Tensor):
                _shard_param(model, path, module, leaf, _Cut(style, rank, size, attn), slices)
        if attn is not None:
            attentions[id(attn)] = attn
    kv_heads = heads
    for attn in attentions.values():        # after every cut: the cuts read the model's head counts
        kv_heads = _localize_heads(attn, rank, size)
    model.__dict__["kv_cache_spec"] = lambda: (kv_heads, head_dim)
    model.__dict__["tp_slices"] = slices
    model.__dict__["tp_rank"], model.__dict__["tp_size"] = rank, size
    model.__dict__.pop("_weight_table", None)           # the slots changed
    return model


@dataclass(frozen=True)
class _Cut:
    """How one module is split: its style, the rank, and (q/k/v, attention output) its attention module."""
    style: str
    rank: int
    size: int
    attn: Any                     # the attention module (q/k/v, attention output), else None

    def dim(self, module: nn.Module, leaf: str) -> int | None:
        """The dim of our parameter (= of its checkpoint tensor) that is split; None: not split."""
        in_out = type(module).__name__ == "Conv1D" or bool(getattr(module, "in_out_layout", False))
        if leaf == "bias":
            return 0 if self.style in (QKV, COLUMN) else None
        rows = 1 if in_out else 0
        return 1 - rows if self.style in (ROW, OUT) else rows

    def ranges(self, part: str, extent: int) -> tuple[tuple[int, int], ...]:
        if self.style not in (QKV, OUT):
            n = extent // self.size
            return ((self.rank * n, n),)
        attn = self.attn
        hq, d = attn.num_heads, attn.head_dim
        hkv = getattr(attn, "num_kv_heads", hq)
        (q0, qn), (k0, kn) = head_ranges(hq, hkv, self.rank, self.size)
        if self.style == OUT:                           # the input columns of this rank's q heads
            return ((q0 * d, qn * d),)
        if extent == (hq + 2 * hkv) * d:                # q | k | v in one tensor (GPT-2's c_attn)
            return ((q0 * d, qn * d), ((hq + k0) * d, kn * d), ((hq + hkv + k0) * d, kn * d))
        is_kv = part.rsplit(".", 2)[-2] in ("k_proj", "v_proj")
        return ((k0 * d, kn * d),) if is_kv else ((q0 * d, qn * d),)


def _shard_param(model: Any, path: str, module: Any, leaf: str, cut: _Cut, slices: dict[str, Slice]) -> None:
    param = getattr(module, leaf)
    dim = cut.dim(module, leaf)
    hf_parts = getattr(module, "hf_parts", None)
    parent = path.rsplit(".", 1)[0]
    # checkpoint tensors stacked along dim 0 of the parameter: (our name, extent along dim 0)
    parts = ([(f"{parent}.{p}.{leaf}", rows) for p, rows in hf_parts] if hf_parts
             else [(f"{path}.{leaf}", param.shape[0])])
    pieces, offset = [], 0
    for name, rows in parts:
        part = param.narrow(0, offset, rows)
        offset += rows
        if dim is None:              # a row-parallel bias: rank 0 adds it once, the others hold zeros
            piece = Slice(0, rows, (), zero=True) if cut.rank else None
        else:
            piece = Slice(dim, part.shape[dim], cut.ranges(name, part.shape[dim]), k=cut.style in (ROW, OUT))
        if piece is not None:
            slices[model.hf_name(name)] = piece
        pieces.append(part if piece is None else piece.take(part))
    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
    module._parameters[leaf] = nn.Parameter(value.clone(), requires_grad=False)
    if leaf == "weight":
        if hf_parts:
            module.hf_parts = tuple((p, piece.shape[0]) for (p, _), piece in zip(hf_parts, pieces))
        if isinstance(module, nn.Embedding):
            module.num_embeddings = value.shape[0]
        elif isinstance(module, nn.Linear):
            module.out_features, module.in_features = value.shape


def _localize_heads(attn: Any, rank: int, size: int) -> int:
    """The attention module's head counts become this rank's; returns its KV heads."""
    hq = attn.num_heads
    hkv = getattr(attn, "num_kv_heads", hq)
    (_, qn), (_, kn) = head_ranges(hq, hkv, rank, size)
    attn.num_heads = qn
    if hasattr(attn, "num_kv_heads"):
        attn.num_kv_heads = kn
    return kn


def connect(model: Any, group: Group, logits_to: int = 0) -> nn.Module:
    """Add the collectives to a sharded model: an all-reduce after every row-parallel layer and
    around the vocabulary-parallel embedding, and `compute_logits` gathering the vocabulary on rank
    `logits_to` (the rank that samples; -1: every rank; elsewhere the logits are not meaningful)."""
    family = family_of(model)
    assert family is not None and model.__dict__.get("tp_size") == group.size, "connect a model sharded for the group"
    group = model.__dict__["tp_clock"] = Clocked(group)
    for path, module in model.named_modules():
        style = next((s for pattern, s in RULES[family] if fnmatch.fnmatchcase(path, pattern)), None)
        if style in (ROW, OUT):
            module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))
        elif style == VOCAB and hasattr(module, "num_embeddings"):       # the token embedding
            module.forward = _vocab_lookup(module, group)
    base = model.compute_logits
    model.__dict__["compute_logits"] = lambda hidden: group.all_gather(base(hidden), logits_to)
    return model


class Clocked:
    """A group whose calls add up their seconds (waiting for the slowest rank included): `seconds`."""

    def __init__(self, group: Group):
        self.group, self.rank, self.size, self.seconds = group, group.rank, group.size, 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.group.all_reduce(x)
        self.seconds += time.perf_counter() - t0
        return out

    def all_gather(self, x: torch.Tensor, dst: int = -1) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.group.all_gather(x, dst)
        self.seconds += time.perf_counter() - t0
        return out


def _vocab_lookup(module: Any, group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The embedding's forward on this rank's vocabulary rows: ids elsewhere give zeros, and the
    all-reduce adds every rank's rows (each id's row comes from exactly one rank)."""
    lookup = type(module).forward
    rows = module.num_embeddings
    first = group.rank * rows

    def forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - first
        mine = (local >= 0) & (local < rows)
        out = lookup(module, torch.where(mine, local, 0))
        return group.all_reduce(torch.where(mine.unsqueeze(-1), out, 0))
    return forward
