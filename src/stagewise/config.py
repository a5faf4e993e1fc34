"""EngineConfig: one frozen, validated description of an engine, split by concern (load, cache,
scheduler, parallel, cluster, recovery, graphs, request limits); CLI flags are projections of the
concerns' fields (each carries its help text, see `flag`). `parse_size` is the one size rule of
every option.

Derived values are properties. Policy that needs the model (graph buckets, memory) is
resolved later by the pieces that own it, from these fields.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import envs

GIB = 1 << 30
# NOTE: graph/policy.py keeps a copy; it belongs here (config may not import graph/)
PREFILL_GRAPH_CHOICES = ("auto", "breakable", "full", "compiled", "off")
PARTITION_MODES = ("auto", "even")
PP_NODE_FIT_CHOICES = ("memory", "speed", "off")
MIN_SIZE_BYTES = 4096          # smaller sizes are almost surely a missing unit ("2" for 2GiB)
_UNITS = {"tib": 1 << 40, "gib": GIB, "mib": 1 << 20, "kib": 1 << 10, "tb": 10**12, "gb": 10**9, "mb": 10**6,
          "kb": 10**3, "t": 1 << 40, "g": GIB, "m": 1 << 20, "k": 1 << 10, "b": 1}


def flag(default, help: str, **meta):
    """A dataclass field that is also a command-line flag: its help text (and `size`, `aliases`,
    `flag`, `cli` hints) travel in the field's metadata, where cli.py reads them."""
    return field(default=default, metadata={"help": help, **meta})


def parse_size(value, name: str) -> int:
    """A size in bytes from bytes (int) or text: '4GiB', '512MiB', '2g' (binary), '1GB' (decimal),
    '4194304' (bytes). The one size rule of every flag and option; `name` goes in the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be a size such as 2GiB or a number of bytes, not {type(value).__name__}.")
    text = str(value).strip().lower().replace(" ", "")
    suffix = next((s for s in _UNITS if text.endswith(s) and text[:-len(s)]), "")
    try:
        size = int(float(text[:len(text) - len(suffix)]) * _UNITS.get(suffix, 1))
    except ValueError:
        raise ValueError(f"{name} {value!r} is not a size; write bytes or a unit, e.g. 2GiB or 512MiB.") from None
    if size < MIN_SIZE_BYTES:
        raise ValueError(f"{name} {value!r} is {size} bytes, less than {MIN_SIZE_BYTES}; write a unit, e.g. 2GiB.")
    return size


SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): the driver proposes up to
    `num_speculative_tokens` tokens per running request, verified in one forward through the
    pipeline. `ngram`: the tokens that followed the latest earlier occurrence of the sequence's
    suffix (`prompt_lookup_max` down to `prompt_lookup_min` tokens long). `draft_model`: a small
    `model` of the same tokenizer, run greedily beside the driver (one process, its own KV cache of
    `draft_kv_cache_memory` bytes, its prefix cache keeping each request's context).
    A request whose acceptance over its last `backoff_window` proposed tokens falls below
    `backoff_min_acceptance` stops proposing for `backoff_steps` steps (twice as long each time
    it happens again to the request, up to 8x). With `adaptive_draft_length` a request proposes
    at most one more draft than it last accepted, and twice as many after a fully accepted step
    (up to `num_speculative_tokens`)."""
    method: str = "ngram"
    model: str | None = None
    draft_kv_cache_memory: int | str = "256MiB"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    backoff_window: int = 16
    backoff_min_acceptance: float = 0.15
    backoff_steps: int = 32
    adaptive_draft_length: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}.")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config needs a model (a checkpoint directory or .gguf file of the same "
                             "tokenizer) with method draft_model, and none with ngram.")
        _set(self, "draft_kv_cache_memory", parse_size(self.draft_kv_cache_memory,
                                                       "speculative_config draft_kv_cache_memory"))
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "backoff_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({self.prompt_lookup_max}).")
        if not isinstance(self.backoff_steps, int) or isinstance(self.backoff_steps, bool) or self.backoff_steps < 0:
            raise ValueError(f"speculative_config backoff_steps must be an integer >= 0, got {self.backoff_steps!r}.")
        if not isinstance(self.adaptive_draft_length, bool):
            raise ValueError(f"speculative_config adaptive_draft_length must be true or false, "
                             f"got {self.adaptive_draft_length!r}.")
        rate = self.backoff_min_acceptance
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= 1:
            raise ValueError(f"speculative_config backoff_min_acceptance must be a number in [0, 1], got {rate!r}.")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a JSON object as text (the CLI), a dict (`LLM(speculative_config={...})`) or an instance."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"speculative_config must be a JSON object such as {SPECULATIVE_EXAMPLE}, "
                                 f"got {value!r}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), not {type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}.")
        if "method" not in value and "model" in value:      # vLLM's spelling of a draft model
            value = {**value, "method": "draft_model"}
        if "method" not in value:
            raise ValueError("speculative_config needs a method, e.g. {\"method\": \"ngram\"}.")
        return cls(**value)


@dataclass(frozen=True)
class LoadConfig:
    """The checkpoint and how it loads: which file, tokenizer, dtype, device, weight quantization."""
    model: str | None = flag(None, "HF checkpoint directory or .gguf file; 'demo' for the tiny random demo model "
                             "(default: SmolLM2-135M-Instruct, downloaded once)")
    tokenizer: str | None = flag(None, "tokenizer directory (default: the model's)")
    dtype: str = flag("auto", "auto | float32 | bfloat16 | float16; auto: bf16 on CPUs with native bf16 for models of "
                      "hidden >= 256, else fp32; on CUDA the checkpoint's. Quantized weights: float32 named here "
                      "runs them exactly (float32 activations), anything else in the kernels' fast mode")
    quantization: str | None = flag(None, "int8 | int4: quantize a float HF checkpoint's weights at load "
                                    "(weight-only, per 32 values: int8 as Q8_0; int4 as Q4_1, embeddings and LM "
                                    "head at 8 bits); GGUF files keep their own types (default: off)")
    device: str = flag("auto", "auto | cpu | cuda; auto: cuda when available")
    seed: int = flag(0, "seed of the engine's random state")
    pooling: str = flag("auto", "auto | last | mean: how embedding requests pool the prompt's last hidden states; "
                        "auto: the checkpoint's sentence-transformers Pooling config, else last")
    lora_modules: tuple[str, ...] | None = flag(None, "LoRA adapters (PEFT directories or GGUF LoRA files) as "
                                                "name=path ...; a request names one as its model (default: none)",
                                                nargs="+")
    max_loras: int = flag(4, "most LoRA adapters one engine holds (--lora-modules)")
    max_lora_rank: int = flag(64, "largest LoRA rank an adapter may have")
    enable_lora_runtime_updates: bool = flag(False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                             "(vLLM's runtime LoRA updates); stages run eager, as with adapters")

    def __post_init__(self):
        if self.lora_modules is not None:
            _set(self, "lora_modules", _lora_specs(self.lora_modules))
            if len(self.lora_modules) > self.max_loras:
                raise ValueError(f"{len(self.lora_modules)} LoRA adapters given, more than max_loras "
                                 f"{self.max_loras}; raise --max-loras.")
        _positive(self, "max_loras", "max_lora_rank")
        if self.pooling not in ("auto", "last", "mean"):
            raise ValueError(f"pooling must be auto, last or mean, got {self.pooling!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be int8 or int4, got {self.quantization!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: block size, its memory, the prefix cache and its disk tier."""
    block_size: int = flag(16, "tokens per KV cache block")
    kv_cache_memory: int | None = flag(None, "KV cache bytes per stage, e.g. 2GiB (default: what is left of the "
                                       "memory this process may use — MemAvailable and the cgroup limit, less a margin "
                                       "of 10%% (at least 512MiB), shared by the node's stages — after weights and "
                                       "activations, at most what max_num_seqs full-length sequences need)", size=True)
    node_memory_bytes: int | None = flag(None, "bytes the engine may use on each node (measured once before any "
                                         "stage loads)", cli=False)
    enable_prefix_caching: bool = flag(True, "share KV blocks of common prompt prefixes")
    kv_cache_disk: int | None = flag(None, "disk bytes the prefix cache may keep KV pages in, e.g. 20GiB, split "
                                     "over the stages by their layers; pages survive restarts (default: off — they "
                                     "hold prompts at rest; 0 is off too)", size=True)
    kv_cache_dir: str | None = flag(None, "directory of the KV disk tier (default: $STAGEWISE_CACHE/kv); made "
                                    "private (0700), its files 0600")
    kv_cache_dtype: str = flag("auto", "how the KV cache stores keys and values: auto (the model's dtype) | bf16 | "
                               "q8_0 | q4_0 (llama.cpp's blocks of 32 values with an fp16 scale: 34 or 18 bytes "
                               "per 32 values, 0.53x or 0.28x of bf16)")

    def __post_init__(self):
        if self.kv_cache_memory is not None:
            _set(self, "kv_cache_memory", parse_size(self.kv_cache_memory, "kv_cache_memory"))
        if self.kv_cache_disk is not None:            # 0: off, as no size
            disk = None if str(self.kv_cache_disk).strip() == "0" else parse_size(self.kv_cache_disk, "kv_cache_disk")
            _set(self, "kv_cache_disk", disk)
        _positive(self, "block_size")
        _set(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))


KV_CACHE_DTYPES = ("auto", "bf16", "q8_0", "q4_0")


def check_kv_cache_dtype(name) -> str:
    """`name` (lower-cased) when the KV cache can store it, else one sentence saying what to use."""
    text = str(name).strip().lower()
    if text.startswith("fp8"):
        raise ValueError(f"kv_cache_dtype {name!r}: stagewise has no fp8 KV cache (CPUs have no fp8 arithmetic); "
                         "use q8_0 (8-bit codes with a scale per 32 values, 0.53x the bytes of bf16).")
    if text == "bfloat16":
        text = "bf16"
    if text not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}.")
    return text


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step holds: the running batch, the token budget, chunking, speculation."""
    max_num_seqs: int = flag(64, "requests in the running batch, at most")
    max_model_len: int | None = flag(None, "context length (default: the model's max_position_embeddings)")
    chunked_prefill_size: int = flag(512, "token budget of one step (prefill chunks + decodes)")
    enable_dynamic_chunking: bool | None = flag(
        None, "later chunks of a long prompt shrink so each costs about the first's (cost model fitted by a "
        "start-up profile; default: off — the benchmark did not show a win, benchmarks/RESULTS.md)")
    invariant_attention: bool = flag(False, "attend every row of a prefill or verify step with the per-row decode "
                                     "kernel: chunk size, prefix-cache hits, the step budget and speculation then "
                                     "leave token ids and logprob bits unchanged (docs/determinism.md); prefills "
                                     "over 512 tokens take longer")
    speculative_config: SpeculativeConfig | None = flag(
        None, f"speculation (ngram, or draft_model with a model) as JSON, e.g. '{SPECULATIVE_EXAMPLE}' (default: off)")

    def __post_init__(self):
        _set(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _positive(self, "max_num_seqs", "chunked_prefill_size")

    @property
    def dynamic_chunking(self) -> bool:
        """Whether long prompts get cost-sized chunks (`enable_dynamic_chunking`; unset: off)."""
        return bool(self.enable_dynamic_chunking)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model splits: pipeline stages, tensor-parallel ranks, layers per stage, threads."""
    pp_size: int = flag(1, "pipeline stages (processes)", aliases=("--pipeline-parallel-size",))
    tp_size: int = flag(1, "tensor-parallel ranks (processes) per stage, on the stage's node; they split every "
                        "layer's heads, MLP columns and vocabulary (docs/tensor-parallel.md)",
                        aliases=("--tensor-parallel-size",))
    pp_layer_partition: tuple[int, ...] | str | None = flag(
        "auto", "layers per stage: auto (balanced by a per-stage cost model: layers, embedding on the first "
        "stage, final norm + LM head + sampling on the last; `stagewise plan` shows it), even, or counts such "
        "as 3,3,2,2 (kept as given)")
    pp_cost_mix: str = flag("decode", "workload the auto partition balances: decode (every row samples: the LM "
                            "head weighs per token) or prefill (long chunks: the head runs once per chunk)")
    pp_node_rates: tuple[float, ...] | None = flag(
        None, "relative speed of each node for the auto partition, e.g. 1,0.5 (measure each node with "
        "`stagewise plan --measure-rate`; default: all alike)")
    pp_node_fit: str = flag(
        "memory", "across nodes, what a re-partition over the nodes present weighs of what each node reported when "
        "it joined (its available memory and a 50 ms speed probe): memory (every stage fits its node; speeds taken "
        "as equal, or --pp-node-rates), speed (also each node's measured speed), off (the command line's "
        "partition, its stages spread evenly over the nodes present)")
    pp_depth: int | None = flag(None, "plans in flight (default: pp_size to begin with, one more while the busiest "
                                "stage waits on links, up to 4 x pp_size; 1: no micro-batching)")
    threads_per_stage: int | None = flag(None, "torch threads per stage (default: cores / stages per node if "
                                         "pp_size > 1, else torch's)")

    def __post_init__(self):
        value = self.pp_layer_partition
        if isinstance(value, str) and value.strip().lower() in PARTITION_MODES:
            _set(self, "pp_layer_partition", value.strip().lower())
        elif isinstance(value, str):
            _set(self, "pp_layer_partition", _parse_int_list("pp_layer_partition", value))
        elif value is not None:
            _set(self, "pp_layer_partition", tuple(int(v) for v in value))
        if isinstance(self.pp_node_rates, str):
            _set(self, "pp_node_rates", _parse_float_list("pp_node_rates", self.pp_node_rates))
        elif self.pp_node_rates is not None:
            _set(self, "pp_node_rates", tuple(float(v) for v in self.pp_node_rates))
        _positive(self, "pp_size", "tp_size")
        if self.pp_node_fit not in PP_NODE_FIT_CHOICES:
            raise ValueError(f"pp_node_fit must be one of {', '.join(PP_NODE_FIT_CHOICES)}, got {self.pp_node_fit!r}.")
        if self.pp_cost_mix not in ("decode", "prefill"):
            raise ValueError(f"pp_cost_mix must be decode or prefill, got {self.pp_cost_mix!r}.")

    @property
    def depth(self) -> int:
        """Plans the driver keeps in flight."""
        return self.pp_depth or self.pp_size


@dataclass(frozen=True)
class ClusterConfig:
    """The nodes a pipeline spans and the links between them."""
    nnodes: int = flag(1, "nodes of the pipeline")
    node_rank: int = flag(0, "this node's rank in [0, nnodes)")
    local_stages: tuple[int, ...] | None = flag(None, "the stages this node runs in the current pipeline (set "
                                                "where stages start: a re-partition may give a node more or fewer "
                                                "than --pp-size / --nnodes)", cli=False)
    min_nodes: int | None = flag(None, "nodes the first pipeline needs (default: all --nnodes); with fewer, it starts "
                                 "on the nodes ready within --node-rejoin-timeout-s, over a partition they can hold, "
                                 "and the others join the running pipeline when they start (docs/pipelines.md)")
    master_addr: str = flag("127.0.0.1", "address of node 0 (the rendezvous)")
    master_port: int | None = flag(None, "port of the rendezvous (default: a free one; single node only)")
    dist_timeout_s: float = flag(60.0, "seconds a stage may take to answer before it counts as stuck")
    heartbeat_timeout_s: float = flag(5.0, "seconds without a heartbeat from a stage process before it counts as "
                                      "lost (stopped, frozen or cut off); a busy stage keeps beating")
    # NOTE: repr=False: a secret never shows in a log line or a traceback
    cluster_token: str | None = field(default=None, repr=False, metadata={
        "help": "secret every node of a pipeline must present on each of its connections (default: "
                "$STAGEWISE_CLUSTER_TOKEN, which keeps it out of `ps`; a one-node pipeline makes its own)"})
    dist_ifname: str | None = flag(None, "network interface for traffic between pipeline ranks (default: the one "
                                   "routing to --master-addr; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win when set)")

    def __post_init__(self):
        _positive(self, "nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, {self.nnodes}).")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"min_nodes {self.min_nodes} must be between 1 and nnodes ({self.nnodes}).")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {self.heartbeat_timeout_s!r}.")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("A multi-node run needs --master-port (and --master-addr) on every node.")


@dataclass(frozen=True)
class RecoveryConfig:
    """How a pipeline heals when a stage dies, hangs or loses its link."""
    max_pipeline_restarts: int = flag(3, "pipeline rebuilds allowed within --pipeline-restart-window-s after a stage "
                                      "dies, hangs or loses its link (live requests are recomputed); more fail every "
                                      "request as before; 0: never rebuild")
    pipeline_restart_window_s: float = flag(600.0, "the sliding window --max-pipeline-restarts counts in")
    node_rejoin_timeout_s: float = flag(60.0, "after a failure, seconds a rebuild waits for a remote node to rejoin; "
                                        "then its stages move to node 0 if its memory holds them (else the "
                                        "engine fails); the node gets them back at a later rebuild")
    pipeline_spares: bool = flag(True, "keep a warm process per node (torch and the engine imported) that forks "
                                 "each stage in milliseconds, for any layer range (starts and rebuilds skip the "
                                 "imports); off: every stage process is spawned and imports on its own")
    pipeline_spares_delay_s: float = flag(30.0, "no effect since stages fork from the node's warm process from the "
                                          "first pipeline on (kept so that older command lines run)")

    def __post_init__(self):
        if not isinstance(self.max_pipeline_restarts, int) or self.max_pipeline_restarts < 0:
            raise ValueError(f"max_pipeline_restarts must be a non-negative integer, "
                             f"got {self.max_pipeline_restarts!r}.")
        if not self.node_rejoin_timeout_s > 0:
            raise ValueError(f"node_rejoin_timeout_s must be positive, got {self.node_rejoin_timeout_s!r}.")
        if not self.pipeline_restart_window_s > 0:
            raise ValueError(f"pipeline_restart_window_s must be positive, got {self.pipeline_restart_window_s!r}.")


@dataclass(frozen=True)
class GraphConfig:
    """Captured graphs (docs/graphs.md): which prefill and decode steps replay a graph, and when they compile."""
    prefill_graph: str = flag("auto", " | ".join(PREFILL_GRAPH_CHOICES))
    prefill_graph_max_tokens: int | None = flag(None, "largest captured prefill bucket (default: from the policy)")
    prefill_graph_buckets: tuple[int, ...] | None = flag(None, "explicit bucket list, e.g. 16,32,64")
    decode_graph: bool = flag(False, "capture decode graphs per batch size")
    decode_graph_max_bs: int = flag(32, "largest batch size with a decode graph")
    compile_in_background: bool = flag(True, "compiled graphs build on a background thread while steps run eager, "
                                       "and replace them between steps once ready; off: compile before serving")

    def __post_init__(self):
        if isinstance(self.prefill_graph_buckets, str):
            _set(self, "prefill_graph_buckets", _parse_int_list("prefill_graph_buckets", self.prefill_graph_buckets))
        elif self.prefill_graph_buckets is not None:
            _set(self, "prefill_graph_buckets", tuple(int(v) for v in self.prefill_graph_buckets))
        _positive(self, "decode_graph_max_bs")
        if self.prefill_graph not in PREFILL_GRAPH_CHOICES:
            raise ValueError(f"prefill_graph must be one of {', '.join(PREFILL_GRAPH_CHOICES)}, "
                             f"got {self.prefill_graph!r}.")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for: constraint sizes and their compile budget (docs/security.md), images."""
    grammar_max_bytes: int = flag(64 << 10, "largest JSON schema, regex, grammar or choice list a request may "
                                  "constrain its output with, e.g. 256KiB; larger ones get 400", size=True)
    grammar_max_depth: int = flag(64, "deepest nesting of a constraint (JSON schema objects and arrays, regex or "
                                  "grammar parentheses); deeper ones get 400")
    grammar_max_alternatives: int = flag(1024, "most alternatives in a constraint (choices, enum values, "
                                         "anyOf/oneOf branches, '|'); more get 400")
    grammar_compile_timeout_s: float = flag(10.0, "CPU seconds one grammar may take to compile; slower ones fail "
                                            "their request with 408")
    grammar_memory: int = flag(GIB, "memory the grammar compiles may use together (each of the "
                               "--grammar-compile-workers gets its share); a compile over its share fails its "
                               "request with 400", size=True)
    grammar_compile_workers: int = flag(2, "grammars compiled at once (each in a process of its own)")
    grammar_cache_entries: int = flag(256, "compiled grammars kept for reuse (least recently used out)")
    grammar_cache_memory: int = flag(256 << 20, "memory the kept compiled grammars may use; also the largest "
                                     "compiled grammar a request may need", size=True)
    max_image_bytes: int = flag(10 << 20, "largest encoded image a request may send, in bytes")
    max_image_pixels: int = flag(16_000_000, "most pixels of one image, both as sent and as the model's image "
                                 "processor resizes it (read from the header before decoding)")
    max_image_aspect_ratio: float = flag(20.0, "largest ratio of an image's long side to its short side")
    max_images_per_request: int = flag(8, "most images in one request")
    allowed_image_hosts: str | None = flag(None, "comma-separated hosts whose http(s) image URLs the server may "
                                           "fetch (default: none; images come as data URLs)")
    image_fetch_timeout_s: float = flag(10.0, "seconds one image download may take in all (connect, redirects, "
                                        "body); a slower host fails only its own request with 400")

    def __post_init__(self):
        for name in ("grammar_max_bytes", "grammar_memory", "grammar_cache_memory"):
            _set(self, name, parse_size(getattr(self, name), name))
        _positive(self, "grammar_max_depth", "grammar_max_alternatives", "grammar_compile_workers",
                  "grammar_cache_entries")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s!r}.")


# the concerns of an engine, in the order `--help` shows their flag groups: (attribute, class, group title)
CONCERNS = (("load", LoadConfig, "model and load"), ("cache", CacheConfig, "KV cache"),
            ("scheduler", SchedulerConfig, "scheduler"), ("parallel", ParallelConfig, "parallelism"),
            ("cluster", ClusterConfig, "cluster: nodes and links"), ("recovery", RecoveryConfig, "recovery"),
            ("graphs", GraphConfig, "captured graphs"), ("limits", RequestLimits, "request limits"))
# option name -> the concern holding it; every option name is unique across concerns (they are the flags)
CONCERN_OF = {f.name: attr for attr, cls, _ in CONCERNS for f in fields(cls)}


@dataclass(frozen=True)
class EngineConfig:
    """An engine's whole configuration: one frozen, validated record per concern. Each part goes to
    the piece that owns it (the scheduler reads `scheduler`, the supervisor `recovery` and `cluster`).
    Built from flat options (`from_kwargs`, the flags, `LLM(**options)`), whose names are unique
    across concerns; `replace` takes flat names too."""
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self):
        """What crosses concerns; each concern checked its own fields."""
        p, c = self.parallel, self.cluster
        lora = bool(self.load.lora_modules) or self.load.enable_lora_runtime_updates
        if lora and (self.graphs.prefill_graph not in ("auto", "off") or self.graphs.decode_graph):
            raise ValueError("LoRA adapters (--lora-modules, --enable-lora-runtime-updates) run eager; leave "
                             "--prefill-graph auto (or off) and --decode-graph off.")
        if p.tp_size > 1 and (self.graphs.prefill_graph not in ("auto", "off") or self.graphs.decode_graph):
            raise ValueError(f"tp_size {p.tp_size} runs its stages eager for now; leave --prefill-graph auto "
                             f"(or off) and --decode-graph off, or use tp_size 1 for captured graphs.")
        if p.pp_size % c.nnodes and c.min_nodes is None:
            raise ValueError(f"pp_size {p.pp_size} must be a multiple of nnodes {c.nnodes} (equal stages per "
                             f"node), or give --min-nodes: the driver then places the stages on the nodes it has.")
        rates = p.pp_node_rates
        if rates is not None and (len(rates) != c.nnodes or any(not r > 0 for r in rates)):
            raise ValueError(f"pp_node_rates needs {c.nnodes} positive numbers (one per node), got "
                             f"{','.join(map(str, rates))}; measure each node with "
                             f"`stagewise plan --measure-rate`.")

    @classmethod
    def from_kwargs(cls, **options) -> "EngineConfig":
        """Build from flat option names (the flags' names), refusing unknown ones with a clear error."""
        return cls().replace(**options)

    def replace(self, **options) -> "EngineConfig":
        """A copy with these options changed: flat option names, or whole concerns by attribute."""
        unknown = sorted(set(options) - set(CONCERN_OF) - {attr for attr, _, _ in CONCERNS})
        if unknown:
            raise ValueError(f"Unknown engine option(s): {', '.join(unknown)}; see `stagewise serve --help`.")
        parts = {attr: options[attr] for attr, _, _ in CONCERNS if attr in options}
        for attr, _, _ in CONCERNS:
            mine = {k: v for k, v in options.items() if CONCERN_OF.get(k) == attr}
            if mine:
                parts[attr] = dataclasses.replace(parts.get(attr, getattr(self, attr)), **mine)
        return dataclasses.replace(self, **parts) if parts else self

    def options(self) -> dict:
        """Every option by its flat name: `LLM(**config.options())` builds the same engine."""
        return {f.name: getattr(getattr(self, attr), f.name) for attr, cls, _ in CONCERNS for f in fields(cls)}

    @property
    def stages_per_node(self) -> int:
        c = self.cluster
        return len(c.local_stages) if c.local_stages else max(1, self.parallel.pp_size // c.nnodes)

    def local_slot(self, stage_rank: int) -> int:
        """The place of `stage_rank` among this node's stages (its share of the node's CPUs)."""
        local = self.cluster.local_stages
        return local.index(stage_rank) if local and stage_rank in local else stage_rank % self.stages_per_node

    @property
    def ranks_per_node(self) -> int:
        """Stage processes on one node: its stages times the tensor-parallel ranks of each."""
        return self.stages_per_node * self.parallel.tp_size


def _set(record, name: str, value) -> None:
    """Normalise a field of a frozen record while it is built (sizes, lists given as text)."""
    object.__setattr__(record, name, value)


def _positive(record, *names: str) -> None:
    for name in names:
        value = getattr(record, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def cache_root() -> Path:
    """`$STAGEWISE_CACHE`, else `~/.cache/stagewise`: the demo model, the default model, converted tokenizers."""
    return envs.STAGEWISE_CACHE


def _lora_specs(value) -> tuple[str, ...] | None:
    """`--lora-modules` as name=path texts: from a list, one text, or a {name: path} dict; names unique."""
    if isinstance(value, dict):
        value = [f"{k}={v}" for k, v in value.items()]
    items = [value] if isinstance(value, str) else list(value)
    names = []
    for spec in items:
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entry {spec!r} must be name=path (a PEFT adapter directory).")
        names.append(name.strip())
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules names must be unique, got {', '.join(names)}.")
    return tuple(str(s).strip() for s in items) or None


def _parse_int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of integers, got {text!r}.") from None


def _parse_float_list(name: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of numbers, got {text!r}.") from None
