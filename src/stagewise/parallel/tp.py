"""Tensor parallelism inside a stage: which rank holds which slice of a stage model, and the
collectives that join the slices (Megatron's layout, applied to a built model as gpt-fast does, so
the model files stay as they are).

Column-parallel by output rows: q/k/v (whole KV groups per rank, so every rank keeps the model's q
heads per KV head; `head_ranges`) and gate/up. The attention output and down projections (Megatron
splits them by input columns and all-reduces partial sums) are *gathered* instead: their input is
all-gathered (the attention output's columns follow the ranks' q heads), each rank computes an even
share of the output rows over the whole input, and the rows are all-gathered. Every output is then
one chain over the whole input in one kernel, as in one process (the kernels sum a row's output in
an order that depends neither on the rows nor on the columns of a call), so every tensor-parallel
size gives the one-process bits; partial sums added after the fact would not. Vocabulary-parallel:
the token embedding (each rank looks up its own rows, one all-reduce of zeros and one row each joins
them, exactly) and the LM head (each rank's logits, gathered where sampling runs). `shard` narrows a
model's parameters, on the meta device before loading or loaded ones, and records each checkpoint
tensor's `Slice` for the loader; `connect` adds the collectives.
"""
from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# ROW, OUT: gathered (input all-gathered, output rows split, outputs all-gathered); OUT's input columns
# follow the ranks' q heads (the attention output)
ROWS_BLOCK = 16     # a gathered layer's rows split in blocks of 16: every rank's share stays packable
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
    concatenated, of a dimension `full` long (a weight's output rows, or a vocabulary's)."""
    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.full if d == self.dim else n for d, n in enumerate(local))

    def take(self, tensor: Any) -> Any:
        """This rank's part of the whole `tensor` (a torch tensor, or a kernels.quant.QuantizedWeight:
        its rows, which never split a block)."""
        if isinstance(tensor, torch.Tensor):
            return _cat(tensor, self.dim, self.ranges)
        return tensor.take_rows(torch.cat([torch.arange(s, s + n) for s, n in self.ranges]))


def _cat(t: torch.Tensor, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    parts = [t.narrow(dim, start, n) for start, n in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def family_of(model_or_class: Any) -> str | None:
    """The family whose rules shard this model (by class, or any base class), or None."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    if getattr(cls, "tensor_parallel", True) is False:      # a family that opts out (its layers need whole heads)
        return None
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
                size: int, hidden: int = 0) -> None:
    """One sentence, before any process starts, if `size` ranks cannot split this model."""
    if size == 1:
        return
    if family is None:
        raise ValueError(f"Tensor parallelism supports the Llama (Llama, Mistral, Qwen2, Qwen3; Qwen3-MoE, Qwen2-MoE, "
                         f"Mixtral and gpt-oss with every expert on each rank) and GPT-2 families; "
                         f"{arch} runs with tp_size 1.")
    if num_heads < size:
        raise ValueError(f"tp_size {size} is more than the model's {num_heads} attention heads (each rank needs "
                         f"one); use a tp_size of at most {num_heads}.")
    if hidden and hidden < size * ROWS_BLOCK:
        raise ValueError(f"tp_size {size} is too many ranks for the model's hidden size {hidden} (each rank computes "
                         f"at least {ROWS_BLOCK} of its rows); use a tp_size of at most {hidden // ROWS_BLOCK}.")
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
                or heads, hf_config.vocab_size, intermediate, size, hf_config.hidden_size)


def shard(model: nn.Module, rank: int, size: int) -> nn.Module:
    """Narrow `model`'s parameters to `rank`'s slices (meta or real tensors, before any packing) and
    record each checkpoint tensor's Slice in `model.tp_slices` (by checkpoint name) for the loader."""
    family = family_of(model)
    if family is None:
        raise ValueError(f"Tensor parallelism has no rules for {type(model).__name__}.")
    heads, head_dim = model.kv_cache_spec()            # type: ignore[operator]  # the model contract
    slices: dict[str, Slice] = {}
    gathers: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    attentions: dict[int, tuple[str, Any]] = {}
    for path, module in list(model.named_modules()):
        style = next((s for pattern, s in RULES[family] if fnmatch.fnmatchcase(path, pattern)), None)
        if style is None:
            continue
        if getattr(module, "packed", False):
            raise ValueError(f"{path} holds packed weights; shard a model before its weights are packed.")
        attn = model.get_submodule(path.rsplit(".", 1)[0]) if style in (QKV, OUT) else None
        if style in (ROW, OUT):
            rows = module.weight.shape[1 if _in_out(module) else 0]
            gathers[path] = (_input_columns(module, style, size, attn),
                             tuple(row_share(rows, r, size)[1] for r in range(size)))
        for leaf in ("bias", "weight"):          # the weight last: it rewrites hf_parts to this rank's rows
            if isinstance(getattr(module, leaf, None), torch.Tensor):
                _shard_param(model, path, module, leaf, _Cut(style, rank, size, attn), slices)
        if attn is not None:
            attentions[id(attn)] = (path.rsplit(".", 1)[0], attn)
    kv_heads = heads
    for attn_path, attn in attentions.values():     # after every cut: the cuts read the model's head counts
        _shard_sinks(model, attn_path, attn, rank, size, slices)
        kv_heads = _localize_heads(attn, rank, size)
    model.__dict__["kv_cache_spec"] = lambda: (kv_heads, head_dim)
    model.__dict__["tp_slices"] = slices
    model.__dict__["tp_gathers"] = gathers         # by module path: quantizing replaces the modules
    model.__dict__["tp_rank"], model.__dict__["tp_size"] = rank, size
    model.__dict__.pop("_weight_table", None)           # the slots changed
    return model


def _input_columns(module: Any, style: str, size: int, attn: Any) -> tuple[int, ...]:
    """A gathered layer's input columns on each rank, in order: the attention output's follow the
    ranks' q heads; the down projection's are the ranks' even shares of the intermediate columns."""
    if style == OUT:
        hq, d = attn.num_heads, attn.head_dim
        heads = [head_ranges(hq, getattr(attn, "num_kv_heads", hq), r, size)[0] for r in range(size)]
        assert all(heads[r][0] + heads[r][1] == heads[r + 1][0] for r in range(size - 1)), heads
        return tuple(n * d for _, n in heads)
    k = module.weight.shape[0 if _in_out(module) else 1]
    return (k // size,) * size


def row_share(rows: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s share of a gathered layer's output rows: whole blocks of
    ROWS_BLOCK as even as they go (the last rank also takes a partial block at the end), so each
    rank's weight keeps the packed kernels' layout where the whole one has it."""
    blocks = -(-rows // ROWS_BLOCK)
    first = rank * blocks // size * ROWS_BLOCK
    return first, min(rows, (rank + 1) * blocks // size * ROWS_BLOCK) - first


def _in_out(module: Any) -> bool:
    """The weight is stored [in, out] (GPT-2's Conv1D)."""
    return type(module).__name__ == "Conv1D" or bool(getattr(module, "in_out_layout", False))


@dataclass(frozen=True)
class _Cut:
    """How one module is split: its style, the rank, and (q/k/v, attention output) its attention module."""
    style: str
    rank: int
    size: int
    attn: Any                     # the attention module (q/k/v, attention output), else None

    def dim(self, module: nn.Module, leaf: str) -> int:
        """The dim of our parameter (= of its checkpoint tensor) that is split: the output rows."""
        return 1 if _in_out(module) and leaf == "weight" else 0

    def ranges(self, part: str, extent: int) -> tuple[tuple[int, int], ...]:
        if self.style in (ROW, OUT):
            return (row_share(extent, self.rank, self.size),)
        if self.style != QKV:          # an even share of the rows
            n = extent // self.size
            return ((self.rank * n, n),)
        attn = self.attn
        hq, d = attn.num_heads, attn.head_dim
        hkv = getattr(attn, "num_kv_heads", hq)
        (q0, qn), (k0, kn) = head_ranges(hq, hkv, self.rank, self.size)
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
        piece = Slice(dim, part.shape[dim], cut.ranges(name, part.shape[dim]))
        slices[model.hf_name(name)] = piece
        pieces.append(piece.take(part))
    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
    module._parameters[leaf] = nn.Parameter(value.clone(), requires_grad=False)
    if leaf == "weight":
        if hf_parts:
            module.hf_parts = tuple((p, piece.shape[0]) for (p, _), piece in zip(hf_parts, pieces))
        if isinstance(module, nn.Embedding):
            module.num_embeddings = value.shape[0]
        elif isinstance(module, nn.Linear):
            module.out_features, module.in_features = value.shape


def _shard_sinks(model: Any, path: str, attn: Any, rank: int, size: int, slices: dict[str, Slice]) -> None:
    """gpt-oss's one sink logit per q head: each rank keeps its q heads' sinks."""
    sinks = getattr(attn, "sinks", None)
    if not isinstance(sinks, torch.Tensor):
        return
    (q0, qn), _ = head_ranges(attn.num_heads, getattr(attn, "num_kv_heads", attn.num_heads), rank, size)
    piece = Slice(0, sinks.shape[0], ((q0, qn),))
    slices[model.hf_name(f"{path}.sinks")] = piece
    attn._parameters["sinks"] = nn.Parameter(piece.take(sinks).clone(), requires_grad=False)


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
    """Add the collectives to a sharded model: every gathered layer's input and output all-gathered,
    an all-reduce around the vocabulary-parallel embedding, and `compute_logits` gathering the vocabulary on rank
    `logits_to` (the rank that samples; -1: every rank; elsewhere the logits are not meaningful)."""
    family = family_of(model)
    assert family is not None and model.__dict__.get("tp_size") == group.size, "connect a model sharded for the group"
    group = model.__dict__["tp_clock"] = Clocked(group)
    for path, module in model.named_modules():
        style = next((s for pattern, s in RULES[family] if fnmatch.fnmatchcase(path, pattern)), None)
        if style in (ROW, OUT):
            ins, outs = model.__dict__["tp_gathers"][path]
            module.register_forward_pre_hook(lambda _m, args, c=ins: (_gather_columns(group, args[0], c), *args[1:]))
            module.register_forward_hook(lambda _m, _args, out, c=outs: _gather_columns(group, out, c))
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


def _gather_columns(group: Any, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """Every rank's columns of `x [..., C_r]` side by side, in rank order (`counts`: each rank's C_r;
    where they differ, each is padded to the widest for the gather)."""
    rows = x.reshape(-1, x.shape[-1])
    width = max(counts)
    if rows.shape[1] < width:
        rows = F.pad(rows, (0, width - rows.shape[1]))
    out = group.all_gather(rows.contiguous())
    if any(c != width for c in counts):
        out = torch.cat([out[:, r * width:r * width + c] for r, c in enumerate(counts)], dim=1)
    return out.view(*x.shape[:-1], out.shape[1])


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
