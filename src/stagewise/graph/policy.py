"""Graph policy, resolved once at startup, and the per-step verdict (replay a bucket or run eager).

The driver resolves a `GraphPolicy`, logs its `log_lines`, and calls `decide_verdict` once per
step; the verdict travels in the step plan so every stage replays the same bucket or all run
eager. Plain Python (no torch) so the driver imports it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from ..config import PREFILL_GRAPH_CHOICES
from ..kernels.build import cxx_compiler
from .buckets import decode_bucket_ladder, pick_bucket, prefill_bucket_ladder

DECODE_GRAPH_CHOICES = ("off", "breakable", "full", "compiled")
PP_CAP_CLAMP = 8192          # auto cap under PP when neither a cap nor a list was given
DEFAULT_CAP = 8192           # cap when chunked prefill is disabled (size None)
MAX_PADDING_FACTOR = 2       # a bucket more than twice the live tokens runs eager


@dataclass(frozen=True)
class GraphPolicy:
    """What this engine captures. `buckets`/`decode_buckets` are empty when that kind is off."""

    backend: str = "off"                     # prefill: off | breakable | full | compiled
    buckets: tuple[int, ...] = ()            # prefill token-count buckets, ascending
    max_tokens: int = 0                      # prefill capture cap (rows of the static buffers)
    emulated: bool = False                   # breakable/full without CUDA: a CPU stand-in runs them
    decode_backend: str = "off"              # decode: off | breakable | full | compiled
    decode_buckets: tuple[int, ...] = ()     # decode batch-size buckets, ascending
    log_lines: tuple[str, ...] = ()
    full_slots: int = 16                     # request slots of a `full` prefill graph

    @property
    def enabled(self) -> bool:
        return self.backend != "off" or self.decode_backend != "off"

    @property
    def dynamic_rows(self) -> bool:
        """Prefill replays any row count up to the cap, unpadded (the compiled backend)."""
        return self.backend == "compiled"

    @property
    def decode_dynamic_rows(self) -> bool:
        return self.decode_backend == "compiled"

    @property
    def max_rows(self) -> int:
        """Rows the static buffers need: the largest bucket of either kind."""
        return max(self.buckets[-1:] + self.decode_buckets[-1:], default=0)


@dataclass(frozen=True)
class GraphVerdict:
    """One step's decision, identical on every stage. `bucket` None = eager, `reason` says why."""

    kind: str                    # "prefill" | "decode"
    bucket: int | None
    reason: str | None = None    # too_large | padding | disabled | unservable | empty | <caller's word>


COMPILE_MIN_HIDDEN = 512     # auto compiles CPU stage bodies from this hidden size up (outside the one-call rule below)
# The architectures whose stages run an eager decode step in one native call where their layers are
# packed for stagewise's kernels (model/llama.py `_plan_decode_layers`: Llama-family blocks without q/k
# norms, quantized or float); auto runs them eager.
ONE_CALL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


# Architectures with sliding-window layers (model/sink_attention.py) or linear-attention layers
# (model/qwen3_5.py), which read the live metadata (a graph break in compiled bodies; refused by full
# graphs): auto leaves their graphs off.
EAGER_ARCHITECTURES = ("Gemma3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")


# Architectures with linear-attention layers (model/qwen3_5.py): always eager, their recurrent layers
# loop over the step's sequences and state slots, which no graph captures.
RECURRENT_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")


def policy_for(config, device_type: str) -> GraphPolicy:
    """The policy of an `EngineConfig` on a device type ("cpu" or "cuda"); tensor-parallel stages run eager."""
    graphs = config.graphs
    if ((graphs.prefill_graph not in ("auto", "off") or graphs.decode_graph not in (False, None, "off"))
            and _architecture(config.load.model) in RECURRENT_ARCHITECTURES):
        raise ValueError("Models with linear-attention layers (Qwen3.5, Qwen3-Next) run eager: their recurrent layers "
                         "loop over the step's sequences and state slots, which graphs cannot capture; use "
                         "--prefill-graph off (or auto) and no --decode-graph.")
    # LoRA's per-row adapter groups change each step: those stages run eager too
    eager = (config.parallel.tp_size > 1 or bool(config.load.lora_modules)
             or config.load.enable_lora_runtime_updates)
    prefill_graph = "off" if eager else config.graphs.prefill_graph
    auto_cpu = prefill_graph == "auto" and device_type == "cpu"
    if auto_cpu and _architecture(config.load.model) in EAGER_ARCHITECTURES:
        policy = resolve_graph_policy("off", chunked_prefill_size=config.scheduler.chunked_prefill_size,
                                      pp_size=config.parallel.pp_size, device_type=device_type)
        return replace(policy, log_lines=policy.log_lines + (
            "prefill graphs: off (auto on CPU runs models with sliding-window or linear-attention layers eager)",))
    facts = _cpu_facts(config.load.model, config.load.quantization) if auto_cpu else (None, None)
    return resolve_graph_policy(
        prefill_graph=prefill_graph, max_tokens=config.graphs.prefill_graph_max_tokens,
        buckets=config.graphs.prefill_graph_buckets, chunked_prefill_size=config.scheduler.chunked_prefill_size,
        pp_size=config.parallel.pp_size, device_type=device_type, decode_graph=config.graphs.decode_graph and not eager,
        decode_graph_max_bs=config.graphs.decode_graph_max_bs, hidden_size=facts[0], one_call=facts[1])


def _architecture(model: str) -> str | None:
    from ..checkpoint.facts import read_facts  # lazy: only `auto` on CPU asks (read once per file version)
    return read_facts(model).architecture


@lru_cache(maxsize=8)
def _cpu_facts(model: str, quantization: str | None) -> tuple[int | None, str | None]:
    """The checkpoint's hidden size, and, for an architecture whose decode steps run in one native
    call, why its layers will be packed for stagewise's kernels (None: they will not, or another
    architecture), read once per model: the driver and an in-process stage both ask. A GGUF file's
    metadata is parsed at start-up anyway (its facts are cached per process)."""
    from .. import envs
    from ..checkpoint.facts import read_facts  # lazy: only `auto` on CPU asks
    from ..kernels.build import mode
    facts = read_facts(model)
    hidden = facts.hidden or None
    if facts.architecture not in ONE_CALL_ARCHITECTURES or mode() == "off":
        return hidden, None
    if quantization is not None:
        return hidden, f"--quantization {quantization}"
    if facts.gguf is not None and facts.quantized_as:
        return hidden, f"{Path(facts.gguf).name} holds them as {facts.quantized_as}"
    # float weights: packed wherever the kernels built (every build has the packed float kernels)
    if envs.STAGEWISE_PACKED_WEIGHTS:
        return hidden, "float weights packed for the kernels"
    return hidden, None


def resolve_graph_policy(prefill_graph: str = "auto", max_tokens: int | None = None,
                         buckets: tuple[int, ...] | list[int] | None = None,
                         chunked_prefill_size: int | None = 8192, pp_size: int = 1, device_type: str = "cpu",
                         decode_graph: bool | str = False, decode_graph_max_bs: int = 32,
                         full_slots: int = 16, hidden_size: int | None = None,
                         one_call: str | None = None) -> GraphPolicy:
    """Resolve flags into a policy. Invalid values raise ValueError with one sentence. `hidden_size` and
    `one_call` (why the model's eager decode steps run in one native call; None: they do not) steer
    `auto` on CPU."""
    if prefill_graph not in PREFILL_GRAPH_CHOICES:
        raise ValueError(f"prefill_graph must be one of {', '.join(PREFILL_GRAPH_CHOICES)}, got {prefill_graph!r}.")
    if pp_size < 1:
        raise ValueError(f"pp_size must be at least 1, got {pp_size}.")
    if full_slots < 1:
        raise ValueError(f"full_slots must be at least 1, got {full_slots}.")
    is_cuda = device_type == "cuda"
    logs: list[str] = []
    backend = _resolve_prefill_backend(prefill_graph, pp_size, is_cuda, logs, hidden_size, one_call)
    ladder, cap = _resolve_buckets(max_tokens, buckets, chunked_prefill_size, pp_size)
    decode_backend = _resolve_decode_backend(decode_graph)
    if not is_cuda and "compiled" in (backend, decode_backend) and cxx_compiler() is None:
        backend, decode_backend = _eager_without_compiler(backend, decode_backend, logs)
    if backend == "compiled" and decode_graph in (False, None):
        # NOTE: a second, few-rows compile of the same body: with the rows hinted at one, Inductor
        # keeps its small loops serial instead of opening a parallel region per fused kernel.
        decode_backend = "compiled"
    elif decode_backend == "off" and backend == "compiled":
        logs.append("decode steps replay the compiled prefill body (--decode-graph off)")
    decode_ladder = tuple(decode_bucket_ladder(decode_graph_max_bs)) if decode_backend != "off" else ()
    if decode_backend == "compiled":
        decode_ladder = _warmup_sizes(decode_ladder[-1])
    if backend == "off":
        ladder, cap = (), 0
    elif backend == "compiled":
        ladder = _warmup_sizes(cap)
    emulated = not is_cuda and (backend in ("breakable", "full") or decode_backend in ("breakable", "full"))
    if backend == "compiled":
        logs.append(f"prefill graphs: compiled, any step of up to {cap} tokens at its own size "
                    f"(warm-up sizes {list(ladder)}); larger forwards run eager")
    elif backend != "off":
        logs.append(f"prefill graphs: {backend}, {len(ladder)} buckets {ladder[0]}..{ladder[-1]} "
                    f"(capture cap {cap} tokens); larger forwards run eager")
    if decode_backend == "compiled":
        logs.append(f"decode graphs: compiled for few rows (serial loops), any step of up to {decode_ladder[-1]} "
                    "tokens (decode batches, speculative verify steps, short prefills)")
    elif decode_backend != "off":
        logs.append(f"decode graphs: {decode_backend}, batch sizes {list(decode_ladder)}")
    if emulated:
        logs.append(f"graphs are emulated on {device_type}: no CUDA, so replay re-runs the body on the "
                    "static buffers (same fill/bind/trim code, no speed-up)")
    return GraphPolicy(backend, ladder, cap, emulated, decode_backend, decode_ladder, tuple(logs), full_slots)


def _eager_without_compiler(backend: str, decode_backend: str, logs: list[str]) -> tuple[str, str]:
    """Inductor's CPU code needs a C++ compiler: without one the compiled backends run eager."""
    logs.append("graphs: eager instead of compiled, since Inductor needs a C++ compiler and none was found "
                "($CXX, else g++, on PATH); install g++ or set CXX to compile stage bodies")
    return ("off" if backend == "compiled" else backend), ("off" if decode_backend == "compiled" else decode_backend)


def _warmup_sizes(cap: int) -> tuple[int, ...]:
    """What a dynamic-rows backend compiles at start-up: one graph at the cap, the row count unbacked."""
    return (cap,)


def _resolve_prefill_backend(choice: str, pp_size: int, is_cuda: bool, logs: list[str],
                             hidden_size: int | None = None, one_call: str | None = None) -> str:
    if choice != "auto":
        return choice
    if pp_size > 1:
        # NOTE: under PP, auto leaves graphs off and the log says how to opt in; an explicit choice
        # is kept as given.
        logs.append(f"prefill graphs: off (auto with pp_size={pp_size}); pass --prefill-graph "
                    f"{'breakable to capture them' if is_cuda else 'compiled to compile each stage body'}")
        return "off"
    if not is_cuda:
        if one_call:
            # NOTE: such a stage's eager decode step is one native call (kernels/layers.py), and the C
            # kernels do the heavy work, which Inductor cannot fuse. On SmolLM2-135M (docs/performance.md)
            # compiled steps were no faster at batch 1 (float: 1.2x slower) and no faster over 32
            # requests, prefill 0.9-1.1x, for ~300 MB of resident memory and slow first requests.
            logs.append(f"prefill graphs: off (auto on CPU runs Llama-family models eager: a decode step is one "
                        f"native call; here: {one_call}); pass --prefill-graph compiled to compile anyway")
            return "off"
        if hidden_size is not None and hidden_size >= COMPILE_MIN_HIDDEN:
            return "compiled"
        # NOTE: below that size a model is a test or toy one: its steps are cheap and the compile
        # (tens of seconds on 2 cores) would dominate its start-up.
        logs.append(f"prefill graphs: off (auto on CPU compiles models of hidden size >= {COMPILE_MIN_HIDDEN}; "
                    "pass --prefill-graph compiled to compile this one)")
        return "off"
    return "breakable"


def _resolve_buckets(max_tokens, buckets, chunked_prefill_size, pp_size) -> tuple[tuple[int, ...], int]:
    """Explicit list > explicit cap > chunked-prefill size (clamped to 8192 under PP only)."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"prefill_graph_max_tokens must be a positive integer, got {max_tokens!r}.")
    if buckets is not None:
        ladder = _check_bucket_list(buckets)
        if max_tokens is not None and ladder[-1] > max_tokens:
            raise ValueError(f"prefill graph bucket {ladder[-1]} exceeds prefill_graph_max_tokens {max_tokens}; "
                             "drop the bucket or raise the cap.")
        return ladder, max_tokens if max_tokens is not None else ladder[-1]
    if max_tokens is not None:
        return tuple(prefill_bucket_ladder(max_tokens)), max_tokens
    cap = chunked_prefill_size if chunked_prefill_size else DEFAULT_CAP
    if cap < 1:
        raise ValueError(f"chunked_prefill_size must be positive, got {chunked_prefill_size!r}.")
    if pp_size > 1:
        cap = min(cap, PP_CAP_CLAMP)
    return tuple(prefill_bucket_ladder(cap)), cap


def _check_bucket_list(buckets) -> tuple[int, ...]:
    values = list(buckets)
    if not values or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in values):
        raise ValueError(f"prefill graph buckets must be a non-empty list of positive integers, got {values!r}.")
    return tuple(sorted(set(values)))


def _resolve_decode_backend(decode_graph: bool | str) -> str:
    if decode_graph is True:
        return "full"      # the classic decode graph: whole body, attention included
    if decode_graph is False or decode_graph is None:
        return "off"
    if decode_graph not in DECODE_GRAPH_CHOICES:
        raise ValueError(f"decode_graph must be true, false or one of {', '.join(DECODE_GRAPH_CHOICES)}, "
                         f"got {decode_graph!r}.")
    return decode_graph


def decide_verdict(policy: GraphPolicy, num_tokens: int, is_decode_only: bool, num_seqs: int,
                   unservable: str | None = None) -> GraphVerdict:
    """Graph or eager, and which bucket, for one step; the driver ships it to every stage.

    A decode-only step uses the decode buckets (keyed by `num_seqs`) when decode graphs are on
    and it fits them; anything else uses the prefill buckets. A compiled decode graph (dynamic
    rows) takes every step of up to its cap in tokens, decode-only or not. `unservable` is a short word the
    driver passes when the step needs something no graph can serve; it becomes the reason.
    """
    if policy.decode_dynamic_rows and not unservable and 0 < num_tokens <= policy.decode_buckets[-1]:
        return GraphVerdict("decode", num_tokens)      # the few-rows compile serves any small step
    if is_decode_only and policy.decode_backend != "off":
        verdict = _fit("decode", policy.decode_buckets, num_seqs, unservable, policy.decode_dynamic_rows)
        if verdict.bucket is not None or policy.backend == "off":
            return verdict
    if policy.backend == "off":
        return GraphVerdict("prefill", None, "disabled")
    if policy.backend == "full" and num_seqs > policy.full_slots:
        unservable = unservable or "unservable"
    return _fit("prefill", policy.buckets, num_tokens, unservable, policy.dynamic_rows)


def _fit(kind: str, buckets: tuple[int, ...], n: int, unservable: str | None, dynamic: bool = False) -> GraphVerdict:
    if unservable:
        return GraphVerdict(kind, None, unservable)
    if n < 1:
        return GraphVerdict(kind, None, "empty")
    if dynamic:
        if n > buckets[-1]:
            return GraphVerdict(kind, None, "too_large")
        return GraphVerdict(kind, n, None)
    bucket = pick_bucket(buckets, n)
    if bucket is None:
        return GraphVerdict(kind, None, "too_large")
    if bucket > MAX_PADDING_FACTOR * n:
        return GraphVerdict(kind, None, "padding")
    return GraphVerdict(kind, bucket, None)
